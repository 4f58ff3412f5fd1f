"""Training agents through the agent endpoint: an OpenAI Agents SDK agent with a function tool (the
fully-async trainer, a weight update inside a session) and a litellm one (`inflight train`, exit 0).
What was trained is checked against the engine's own outputs."""

from __future__ import annotations

import asyncio
import json

import pytest
import train_agents
from support import EngineRecords, assert_sample_is_the_engines

from inflight.config import load_config
from inflight.config.job import JobConfig
from inflight.testing import LOCAL_CPU
from inflight.train.main import main, make_task
from inflight.train.runtime import start_local
from inflight.train.staleness import AsyncDataLoader
from inflight.train.trainer import make_trainer

PROBLEMS = 8


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    path = tmp_path_factory.mktemp("agent_data") / "weather.jsonl"
    cities = ["Paris", "Rome", "Oslo", "Lima"]
    path.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"Weather in {cities[i % 4]}?",
                                        "answer": cities[i % 4]}) + "\n" for i in range(PROBLEMS)))
    return path


def overrides(model_dir, data, out, agent: str, *extra: str) -> list[str]:
    return [
        *LOCAL_CPU,
        f"trainer.policy.model.path={model_dir}",
        f"data.train_data=['{data}']",
        f"generator.agent.path=train_agents:{agent}",
        "trainer.train_batch_size=2",
        "trainer.policy_mini_batch_size=2",
        "generator.n_samples_per_prompt=2",
        "trainer.max_training_steps=3",
        "trainer.fully_async.num_parallel_generation_workers=4",
        "trainer.fully_async.max_staleness_steps=2",
        "generator.sampling_params.max_generate_length=16",
        "generator.sampling_params.temperature=1.3",
        "trainer.eval_interval=-1",
        "trainer.policy.optimizer_config.lr=1e-3",
        "trainer.max_prompt_length=512",
        "generator.inference_engine.max_model_len=1024",
        "trainer.algorithm.zero_variance_filter=false",
        "generator.inference_engine.weight_sync_backend=inprocess",
        f"trainer.export_path={out}/export",
        f"trainer.ckpt_path={out}/ckpt",
        "trainer.logger=[console]",
        *extra,
    ]


def test_an_agents_sdk_agent_trains_across_a_weight_update_inside_a_session(model_dir, data, tmp_path):
    cfg = load_config(None, overrides(model_dir, data, tmp_path, "sdk_agent", "trainer.dump_data_batch=true"))
    job = JobConfig(output_dir=str(tmp_path), plot=False)
    task = make_task(cfg, job)
    # groups reach the trainer in the order they start: the third prompt's group is started before the
    # first step (4 workers) and trained after it (2 groups a step), so its sessions can wait for the sync
    third = AsyncDataLoader(task.train_problems(), cfg.trainer.epochs, cfg.trainer.seed).order(0)[2]
    train_agents.WAIT.update(problem=task.train_problems()[third].id, spanned=[])
    records: list[EngineRecords] = []

    async def recording_start(cfg, job, **kwargs):  # the engine's own outputs: the oracle
        runtime = await start_local(cfg, job, **kwargs)
        runtime.client = EngineRecords(runtime.engines.local[0])
        records.append(runtime.client)
        return runtime

    async def run():
        trainer = make_trainer(cfg, job, task, start=recording_start)
        try:
            await trainer.setup()
            return await trainer.train()
        finally:
            await trainer.close()

    history = asyncio.run(run())
    assert len(history) == 3 and all(h["agent/calls_per_episode"] >= 1 for h in history)
    assert set(train_agents.WAIT["spanned"]) == {train_agents.WAIT["problem"]}, (
        "no session waited for the sync"
    )
    outputs = records[0].outputs
    trained = [json.loads(line) for step in range(1, 4)
               for line in (tmp_path / "dumped_data" / f"step_{step}.jsonl").read_text().splitlines()]
    assert len(trained) == 3 * 2 * 2
    mixed = [
        t for t in trained if len({v for v, m in zip(t["versions"], t["loss_mask"], strict=True) if m}) > 1
    ]
    assert mixed, "the session that spanned the update was not trained as one sample with both versions"
    assert any(h["mixed_version_fraction"] > 0 for h in history)
    for t in trained:
        assert_sample_is_the_engines(_Sample(t), outputs)
    assert max(h["weight_version"] for h in history) == 3


class _Sample:
    def __init__(self, row: dict) -> None:
        self.prompt_ids, self.response_ids = row["prompt_ids"], row["response_ids"]
        self.loss_mask, self.logprobs, self.versions = row["loss_mask"], row["logprobs"], row["versions"]


def test_inflight_train_runs_a_litellm_agent(model_dir, data, tmp_path, capsys):
    argv = [*overrides(model_dir, data, tmp_path, "litellm_agent", "trainer.fully_async.enabled=false",
                       "trainer.max_training_steps=2"), f"job.output_dir={tmp_path}", "job.plot=false"]
    assert main(argv) == 0
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in metrics if "agent/calls_per_episode" in m]
    assert len(steps) == 2 and all(m["agent/calls_per_episode"] >= 1 for m in steps)
    assert all(m["samples"] == 4 for m in steps)
