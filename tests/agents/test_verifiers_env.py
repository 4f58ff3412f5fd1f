"""`environment.env_class=verifiers:<env id>`: a verifiers environment made here
(verifiers_envs/tiny_guess.py:
two turns, a dataset built in memory, a rubric) runs in verifiers' own venv (.venv-verifiers, made by
scripts/verifiers_venv.sh): its datasets become the run's data files (the worker's `dataset`
command), and `inflight train` plays its rollouts through the agent endpoint on a tiny model. What was
trained is checked against the engine's own outputs, and each reward against the rubric's function."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
from support import EngineRecords, assert_sample_is_the_engines

import inflight.train.runtime as runtime_module
from inflight.agents.agent import AgentStopped
from inflight.agents.run import uses_agent
from inflight.agents.verifiers_env import (
    VerifiersAgent,
    VerifiersError,
    check_python,
    dataset_command,
    default_python,
    rollout_input,
)
from inflight.agents.verifiers_worker import episode_input
from inflight.config import ConfigError, load_config
from inflight.config.implemented import require_implemented
from inflight.rewards import RewardError, get_reward
from inflight.tasks.base import Problem
from inflight.tasks.data_task import DataTask
from inflight.tasks.dataset import DatasetError
from inflight.testing import LOCAL_CPU
from inflight.train.main import main

ENVS = Path(__file__).with_name("verifiers_envs")
PYTHON = default_python()
SKIP = os.environ.get("INFLIGHT_SKIP_VERIFIERS") == "1"


def score_fn():
    """The rubric's scoring of tiny_guess.py (importable without verifiers)."""
    spec = importlib.util.spec_from_file_location("tiny_guess_score", ENVS / "tiny_guess_score.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.score


def verifiers_venv() -> None:
    """Skip without verifiers' venv only when INFLIGHT_SKIP_VERIFIERS=1 (scripts/test.sh makes it
    otherwise)."""
    if Path(PYTHON).is_file():
        return
    if SKIP:
        pytest.skip(
            f"INFLIGHT_SKIP_VERIFIERS=1 and no verifiers venv at {PYTHON} "
            "(scripts/verifiers_venv.sh makes it)"
        )
    pytest.fail(f"no verifiers venv at {PYTHON}: run scripts/verifiers_venv.sh (~20 s, ~0.5 GB), or set "
                "INFLIGHT_SKIP_VERIFIERS=1 to skip the verifiers tests")


@pytest.fixture
def envs_on_path(monkeypatch):
    # the worker's: verifiers' loader imports tiny_guess from there
    monkeypatch.setenv("PYTHONPATH", str(ENVS))


def test_the_verifiers_keys_are_checked():
    cfg = load_config(
        None,
        [
            *LOCAL_CPU,
            "environment.env_class=verifiers:will/wordle",
            "environment.verifiers.num_train_examples=100",
            "environment.verifiers.use_think=false",
        ],
    )
    require_implemented(cfg)  # no longer refused
    assert cfg.environment.verifiers == {"num_train_examples": 100, "use_think": False} and uses_agent(cfg)
    with pytest.raises(ConfigError) as err:
        load_config(None, [*LOCAL_CPU, "environment.env_class=verifiers:", "environment.verifiers.x=1"])
    assert err.value.keys == ["environment.env_class"]
    with pytest.raises(ConfigError) as err:
        load_config(None, [*LOCAL_CPU, "environment.verifiers.x=1"])
    assert err.value.keys == ["environment.verifiers"]
    with pytest.raises(ConfigError) as err:
        load_config(
            None, [*LOCAL_CPU, "environment.env_class=verifiers:wordle", "generator.agent.path=m:agent"]
        )
    assert err.value.keys == ["generator.agent.path"]
    assert not uses_agent(load_config(None, list(LOCAL_CPU)))
    with pytest.raises(RewardError, match="agent endpoint"):
        get_reward("verifiers:wordle")


def test_rows_and_inputs(tmp_path, tiny_model_factory):
    row = {"id": "train-3", "prompt": [{"role": "user", "content": "Hi"}], "answer": "Lima",
           "verifiers": {"example_id": 3, "task": "guess", "info": {"k": 1}}}
    data = tmp_path / "rows.jsonl"
    data.write_text(
        json.dumps(row) + "\n" + json.dumps({**row, "id": "x", "env_class": "verifiers:other"}) + "\n"
    )
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_factory("qwen2"))
    with pytest.raises(DatasetError, match="rows.jsonl:2: column 'env_class' names 'verifiers:other'"):
        DataTask(tokenizer, [data], [data], env_class="verifiers:tiny-guess")
    data.write_text(json.dumps(row) + "\n")
    task = DataTask(tokenizer, [data], [data], env_class="verifiers:tiny-guess")
    problem = task.train_problems()[0]
    assert rollout_input(problem) == {
        "prompt": row["prompt"],
        "answer": "Lima",
        "example_id": 3,
        "task": "guess",
        "info": {"k": 1},
    }
    with pytest.raises(RewardError, match="verifiers environment"):
        task.make_env(problem)
    plain = Problem("p", "Hi", "4", {"extras": {"answer": "#### 4"}})  # the row's answer as written
    assert rollout_input(plain) == {"prompt": "Hi", "answer": "#### 4", "example_id": 0, "info": {}}
    with pytest.raises(VerifiersError, match="scripts/verifiers_venv.sh"):
        check_python(str(tmp_path / "no-python"))
    chat, completion = SimpleNamespace(message_type="chat"), SimpleNamespace(message_type="completion")
    assert episode_input(chat, rollout_input(plain))["prompt"] == [{"role": "user", "content": "Hi"}]
    assert episode_input(completion, rollout_input(plain))["prompt"] == "Hi"
    with pytest.raises(ValueError, match="must be text"):
        episode_input(completion, rollout_input(problem))


def test_a_missing_environment_and_a_dead_worker_are_clear_errors(envs_on_path):
    verifiers_venv()

    async def run():
        with pytest.raises(VerifiersError, match="'no-such-env' could not be loaded.*installed"):
            await VerifiersAgent("no-such-env", model="m").start()
        agent = await VerifiersAgent("tiny-guess", {"num_examples": 2}, model="m").start()
        agent._proc.kill()  # the worker dies: the run stops rather than scoring every episode 0
        with pytest.raises(AgentStopped, match="exited"):
            await agent("http://127.0.0.1:9/v1", "k", Problem("p", "Hi", "Paris"))
        await agent.close()

    asyncio.run(run())


def test_inflight_train_plays_a_verifiers_environment(
    envs_on_path, tiny_model_factory, tmp_path, monkeypatch
):
    verifiers_venv()
    data = tmp_path / "data"
    made = subprocess.run(
        dataset_command("tiny-guess", data, {"num_examples": 4}), capture_output=True, text=True, timeout=120
    )
    assert made.returncode == 0, made.stderr
    assert json.loads(made.stdout) == {str(data / "train.jsonl"): 4, str(data / "validation.jsonl"): 2}
    answers = {r["id"]: r["answer"] for r in map(json.loads, (data / "train.jsonl").read_text().splitlines())}
    records: list[EngineRecords] = []
    start_local = runtime_module.start_local

    async def recording_start(cfg, job, **kwargs):  # the engine's own outputs: the oracle
        runtime = await start_local(cfg, job, **kwargs)
        runtime.client = EngineRecords(runtime.engines.local[0])
        records.append(runtime.client)
        return runtime

    monkeypatch.setattr(runtime_module, "start_local", recording_start)
    model = tiny_model_factory("qwen2")
    argv = [
        *LOCAL_CPU,
        f"trainer.policy.model.path={model}",
        f"data.train_data=['{data / 'train.jsonl'}']",
        f"data.val_data=['{data / 'validation.jsonl'}']",
        "environment.env_class=verifiers:tiny-guess",
        "environment.verifiers.max_turns=2",
        "trainer.fully_async.enabled=false",
        "trainer.train_batch_size=2",
        "trainer.policy_mini_batch_size=2",
        "generator.n_samples_per_prompt=2",
        "trainer.max_training_steps=2",
        "trainer.eval_interval=2",
        "generator.sampling_params.max_generate_length=8",
        "trainer.logger=[console]",
        "trainer.algorithm.zero_variance_filter=false",
        "trainer.dump_data_batch=true",
        "generator.inference_engine.weight_sync_backend=inprocess",
        f"job.output_dir={tmp_path}",
        "job.plot=false",
    ]
    assert main(argv) == 0
    held_out = json.loads((tmp_path / "summary.json").read_text())["eval"]["after"]["validation"]
    assert held_out["num_problems"] == 2 and held_out["reward_failures"] == 0  # the eval dataset, played too
    steps = [
        m for m in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines()) if "samples" in m
    ]
    assert len(steps) == 2 and all(m["agent/calls_per_episode"] == 2 for m in steps)  # two turns each
    # both turns: one token-in/token-out sample
    assert all(m["agent/rewritten_histories"] == 0 for m in steps)
    trained = [json.loads(line) for step in (1, 2)
               for line in (tmp_path / "dumped_data" / f"step_{step}.jsonl").read_text().splitlines()]
    assert len(trained) == 2 * 2 * 2
    from transformers import AutoTokenizer

    tokenizer, score = AutoTokenizer.from_pretrained(model), score_fn()
    for t in trained:
        assert_sample_is_the_engines(_Sample(t), records[0].outputs)
        sampled = [i for i, m in enumerate(t["loss_mask"]) if m]
        runs = [i for i in sampled if i - 1 not in sampled]  # where each turn's sampled tokens start
        assert len(runs) == 2 and 0 in [t["loss_mask"][i] for i in range(runs[1])]  # turn, observation, turn
        last = [t["response_ids"][i] for i in sampled if i >= runs[1]]
        reply = tokenizer.decode(last, skip_special_tokens=True)
        assert t["reward"] == score(reply, answers[t["prompt_id"]]), (reply, t["reward"])


class _Sample:
    def __init__(self, row: dict) -> None:
        self.prompt_ids, self.response_ids = row["prompt_ids"], row["response_ids"]
        self.loss_mask, self.logprobs, self.versions = row["loss_mask"], row["logprobs"], row["versions"]
