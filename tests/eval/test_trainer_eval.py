"""Evaluation inside `inflight train`: SkyRL's eval keys reach the run (before training, every
`trainer.eval_interval` steps, after), per data set in metrics.jsonl and in the sample dumps; the
old `job.eval_interval` spelling still works; the plot draws lengths and truncation."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from inflight.config import ConfigError
from inflight.tasks import AdditionTask, build_base_model
from inflight.testing import LOCAL_CPU
from inflight.train.main import eval_label, resolve_config, run_job

NUM_EVAL, EVAL_N = 6, 2


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_base_model(tmp_path_factory.mktemp("base"), seed=0, hidden_size=64, num_hidden_layers=2,
                            intermediate_size=128)


def tiny_run(model_dir, out, overrides=()):
    return resolve_config(None, [
        *LOCAL_CPU, f"trainer.policy.model.path={model_dir}", "trainer.train_batch_size=2",
        "trainer.policy_mini_batch_size=2",
        "trainer.fully_async.num_parallel_generation_workers=2", "trainer.micro_train_batch_size_per_gpu=64",
        "generator.n_samples_per_prompt=2", "generator.inference_engine.weight_sync_backend=inprocess",
        "generator.inference_engine.num_kv_blocks=64", "generator.inference_engine.max_num_seqs=32",
        f"job.output_dir={out}", "job.tensorboard=false", "job.progress=false", "job.max_steps=3",
        f"job.num_eval={NUM_EVAL}", "job.max_train_seconds=null", *overrides,
    ])


def test_eval_keys_reach_the_run(model_dir, tmp_path):
    cfg, job = tiny_run(model_dir, tmp_path, [
        "trainer.eval_interval=2", f"generator.eval_n_samples_per_prompt={EVAL_N}",
        "generator.eval_sampling_params.temperature=1.0", "generator.eval_sampling_params.top_k=5",
        "job.plot=true"])
    lines: list[str] = []
    task = AdditionTask(max_digits=1, num_eval=NUM_EVAL, num_train=40)
    summary = asyncio.run(run_job(cfg, job, task, lines.append))
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    evaluated = [r["step"] for r in records if "eval/accuracy" in r]
    assert evaluated == [0, 2, 3]  # before, at the interval, after the last step
    assert [r["step"] for r in records if "reward" in r] == [1, 2, 3]
    for r in (r for r in records if "eval/accuracy" in r):
        assert {"eval/addition/pass@1", "eval/addition/pass@2", "eval/addition/mean_reward",
                "eval/addition/num_problems"} <= set(r)
        assert r["eval/addition/pass@1"] <= r["eval/addition/pass@2"]
        assert r["eval/addition/num_problems"] == NUM_EVAL
        assert r["eval/accuracy"] == r["eval/addition/pass@1"]
    for step in (0, 2, 3):
        dump = tmp_path / "eval" / f"step_{step}"
        samples = [json.loads(line) for line in (dump / "samples.jsonl").read_text().splitlines()]
        assert len(samples) == NUM_EVAL * EVAL_N and {s["data"] for s in samples} == {"addition"}
        assert max(s["response_tokens"] for s in samples) <= task.max_new_tokens
        assert json.loads((dump / "metrics.json").read_text())["addition"]["num_samples"] == NUM_EVAL * EVAL_N
    before = next(line for line in lines if "before RL" in line)  # after the run's precision line
    assert before.startswith("pass@1 (n=2, temperature 1) before RL: ")
    assert f"({NUM_EVAL} held-out problems)" in before
    assert summary["eval"]["after"]["addition"]["num_problems"] == NUM_EVAL and summary["steps"] == 3
    assert (tmp_path / "reward_staleness.png").read_bytes()[:4] == b"\x89PNG"


def test_eval_off_and_without_dumps(model_dir, tmp_path):
    cfg, job = tiny_run(model_dir, tmp_path, ["trainer.eval_interval=0", "job.plot=false", "job.max_steps=1"])
    summary = asyncio.run(run_job(cfg, job, AdditionTask(max_digits=1, num_eval=4, num_train=8), print))
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert summary["before"] is None and summary["after"] is None
    assert not [k for r in records for k in r if k.startswith("eval/")] and not (tmp_path / "eval").exists()


def test_the_demo_job_evaluates_greedily_every_100_steps():
    demo = Path(__file__).resolve().parents[2] / "examples" / "default.yaml"
    cfg, job = resolve_config(str(demo), [])
    assert cfg.trainer.eval_interval == 100 and cfg.trainer.eval_before_train
    assert eval_label(cfg) == "greedy accuracy" and cfg.generator.eval_n_samples_per_prompt == 1
    assert job.eval_interval is None  # the default job spells it trainer.eval_interval


def test_job_eval_interval_is_the_old_spelling():
    cfg, _ = resolve_config(None, ["job.eval_interval=7"])
    assert cfg.trainer.eval_interval == 7
    cfg, _ = resolve_config(None, ["job.eval_interval=7", "trainer.eval_interval=7"])
    assert cfg.trainer.eval_interval == 7
    with pytest.raises(ConfigError) as err:
        resolve_config(None, ["job.eval_interval=7", "trainer.eval_interval=3"])
    assert err.value.keys == ["job.eval_interval"] and "trainer.eval_interval" in str(err.value)


def test_eval_keys_are_validated():
    with pytest.raises(ConfigError) as err:
        resolve_config(None, ["trainer.eval_interval=-2", "generator.eval_n_samples_per_prompt=0",
                              "generator.eval_sampling_params.temperature=-0.5",
                              "generator.eval_sampling_params.top_p=1.5"])
    assert sorted(err.value.keys) == ["generator.eval_n_samples_per_prompt",
                                      "generator.eval_sampling_params.temperature",
                                      "generator.eval_sampling_params.top_p", "trainer.eval_interval"]


def test_the_plot_draws_each_validation_set(tmp_path):
    from inflight.tracking.metrics import MetricsLogger, _eval_series, plot_metrics, read_metrics

    logger = MetricsLogger(tmp_path, progress=False)
    for step in range(4):
        logger.log(step, {"time": float(step), "reward": 0.1 * step, "response_length": 10.0 + step,
                          "truncated_fraction": 0.25, "staleness_mean": 0.5, "staleness_max": 1.0,
                          **({"eval/gsm8k/pass@1": 0.2, "eval/math/pass@1": 0.1, "eval/accuracy": 0.15}
                             if step % 2 == 0 else {})})
    logger.close()
    assert [label for _, label in _eval_series(read_metrics(tmp_path / "metrics.jsonl"))] == \
        ["held-out pass@1: gsm8k", "held-out pass@1: math"]
    assert plot_metrics(tmp_path / "metrics.jsonl", tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"


def test_the_fully_async_trainer_evaluates_beside_the_next_training_step(model_dir, tmp_path):
    """Fully async: the evaluation of step k's weights is started after step k and still open when
    step k+1 trains (the trainer's core trains while the engine evaluates); it ends before step
    k+1's sync replaces those weights, and its metrics are a record of step k at step k's time."""
    from inflight.train.trainer import FullyAsyncTrainer, make_trainer

    cfg, job = tiny_run(model_dir, tmp_path, ["trainer.eval_interval=1", "trainer.fully_async.enabled=true",
                                              "trainer.eval_before_train=false", "job.plot=false"])
    task = AdditionTask(max_digits=1, num_eval=NUM_EVAL, num_train=40)
    seen: dict[str, list] = {"train": [], "sync": []}

    async def main():
        trainer = make_trainer(cfg, job, task)
        assert isinstance(trainer, FullyAsyncTrainer)
        try:
            await trainer.setup()
            train, sync = trainer.policy.train, trainer.restarts.sync

            async def train_and_look(*args, **kwargs):
                seen["train"].append(trainer._evaluation and trainer._evaluation[0])
                return await train(*args, **kwargs)

            async def sync_and_look(policy):
                seen["sync"].append(trainer._evaluation)
                return await sync(policy)

            trainer.policy.train, trainer.restarts.sync = train_and_look, sync_and_look
            return await trainer.train()
        finally:
            await trainer.close()

    history = asyncio.run(main())
    assert seen["train"] == [None, 1, 2]  # steps 2 and 3 trained with the last step's evaluation open
    assert seen["sync"] == [None, None, None]  # and every sync waited for it
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], "reward" in r) for r in records] == [
        (1, True), (1, False), (2, True), (2, False), (3, True), (3, False)]
    steps = {r["step"]: r for r in records if "reward" in r}
    for r in (r for r in records if "reward" not in r):
        assert r["time"] == steps[r["step"]]["time"] and r["eval/addition/num_problems"] == NUM_EVAL
    assert [r["step"] for r in history] == [1, 2, 3]
