"""End-to-end runs of both trainers with a real engine and a real model (tiny sizes, few steps):
every KV fate, the engine in process and in its own process (shared-memory weights), the metrics
file holding every field, weight versions advancing with the steps."""

from __future__ import annotations

import asyncio
import gc
import json

import pytest
from rl_support import rl_config, small_task, warm_model_dir

from inflight.train.trainer import FullyAsyncTrainer, SyncTrainer, make_trainer

REQUIRED = (
    "reward", "accuracy", "staleness_mean", "staleness_max", "is_ratio_mean", "is_ratio_max", "is_ratio_min",
    "kv/resets", "kv/kv_invalidated_resets", "kv/recomputed_tokens", "kv/preemptions", "timing/wait_s",
    "timing/train_s", "timing/sync_s", "timing/pause_s", "timing/step_s", "throughput/tokens_per_s",
    "throughput/samples_per_s", "weight_version", "time", "train_s", "train_cpu_s",
)

FATES = {
    "keep": ["generator.inference_engine.weight_sync_backend=inprocess"],
    "offload": ["generator.inference_engine.weight_sync_backend=inprocess",
                "generator.inference_engine.offload_kv_for_weight_sync=true"],
    "recompute": ["generator.inference_engine.weight_sync_backend=shm",
                  "trainer.fully_async.clear_kv_cache_on_weight_sync=true"],
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return warm_model_dir(tmp_path_factory)


def _train(cfg, job, task=None, evaluate=False):
    task = task or small_task()

    async def main():
        trainer = make_trainer(cfg, job, task)
        try:
            await trainer.setup()
            before = await trainer.evaluate() if evaluate else None
            log, trainer.frozen_at_steps = trainer.logger.log, []

            def log_and_look(step, metrics):  # what the heap looks like while the loop runs
                trainer.frozen_at_steps.append(gc.get_freeze_count())
                return log(step, metrics)

            trainer.logger.log = log_and_look
            history = await trainer.train()
            trainer.frozen_after = gc.get_freeze_count()
            version = await trainer.client.weight_version()
            after = await trainer.evaluate() if evaluate else None
            trainer.engine_step_threads = [e.health()["threads"] for e in trainer.runtime.engines.local]
            return trainer, history, version, before, after
        finally:
            await trainer.close()

    return asyncio.run(main())


@pytest.mark.parametrize("fate", list(FATES))
def test_fully_async_each_kv_fate(model_dir, tmp_path, fate):
    cfg, job = rl_config(model_dir, tmp_path, FATES[fate] + ["job.max_steps=4", "job.lend_threads=true"])
    trainer, history, version, _, _ = _train(cfg, job)
    assert isinstance(trainer, FullyAsyncTrainer) and trainer.policy.plan.kv_fate == fate
    assert len(history) == 4 and version == 4 == trainer.global_step
    # the setup's objects sit in the permanent generation while the loop runs, and leave it after
    assert len(trainer.frozen_at_steps) == 4 and min(trainer.frozen_at_steps) > 10_000
    assert trainer.frozen_after == 0
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    for r in records:
        missing = [k for k in REQUIRED if k not in r]
        assert not missing, f"step {r['step']} lacks {missing}"
        assert 0 <= r["staleness_mean"] <= r["staleness_max"] <= cfg.trainer.fully_async.max_staleness_steps
        assert r["samples"] == 16 and r["weight_version"] == r["step"]
    assert max(r["staleness_max"] for r in records) >= 1  # generation ran ahead of training
    # the steps take the engine's thread only while generation is ahead, the engine the trainer's
    # only while it waits for groups: before the first step it has none to train, so the engine's
    # first steps ran with both threads (in this process, or in its own through shared memory)
    assert set(trainer.policy.lending.seen) <= {1, 2} and trainer.engine_step_threads in ([1], [2], [])
    assert all(0.0 <= r["threads/engine_lent_fraction"] <= 1.0 for r in records)
    assert records[0]["threads/engine_lent_fraction"] > 0.0 and records[0]["threads/engine_steps"] > 0
    consumed = [json.loads(line) for line in (tmp_path / "consumed.jsonl").read_text().splitlines()]
    ids = [i for c in consumed for i in c["trained"]]
    assert len(ids) == 16 == len(set(ids))


def test_sync_trainer_is_on_policy(model_dir, tmp_path):
    cfg, job = rl_config(model_dir, tmp_path, ["trainer.fully_async.enabled=false", "job.max_steps=3",
                                               "job.lend_threads=true"])
    trainer, history, version, before, after = _train(cfg, job, evaluate=True)
    assert isinstance(trainer, SyncTrainer) and trainer.policy.plan.kv_fate == "none"
    assert min(trainer.frozen_at_steps) > 10_000 and trainer.frozen_after == 0
    assert version == 3 and [r["staleness_max"] for r in history] == [0.0, 0.0, 0.0]
    assert all(r["off_policy"] == 0.0 for r in history if "off_policy" in r)
    assert all(abs(r["is_ratio_mean"] - 1.0) < 1e-3 for r in history if r.get("optimizer_steps"))
    assert 0.0 <= before["accuracy"] <= 1.0 and 0.0 <= after["accuracy"] <= 1.0
    # every core to the phase that runs: the engine generates and the step trains with both threads
    assert trainer.policy.lending.seen == [2] and trainer.engine_step_threads == [2]


def test_dynamic_sampling_and_data_end(model_dir, tmp_path):
    """Groups without signal are rejected at generation (their slots are reused); the data runs out
    in the middle of a step and the last, partial batch is still trained."""
    task = small_task(num_train=18)
    cfg, job = rl_config(model_dir, tmp_path, ["job.dynamic_sampling=true", "job.max_steps=null"])
    trainer, history, _, _, _ = _train(cfg, job, task)
    consumed = [json.loads(line) for line in (tmp_path / "consumed.jsonl").read_text().splitlines()]
    trained = [i for c in consumed for i in c.get("trained", [])]
    rejected = [i for c in consumed for i in c.get("rejected", [])]
    assert sorted(trained + rejected) == sorted(p.id for p in task.train_problems())
    assert all(r["groups"] <= 4 for r in history) and trainer.loader.exhausted


def test_colocated_sync_trainer_sleeps_and_wakes_the_engine(model_dir, tmp_path):
    cfg, job = rl_config(model_dir, tmp_path, ["trainer.fully_async.enabled=false",
                                               "trainer.placement.colocate_all=true", "job.max_steps=2"])
    trainer, history, version, _, after = _train(cfg, job, evaluate=True)
    assert trainer.policy.plan.colocated and version == 2
    assert "wake_up_weights" in trainer.policy.plan.steps() and after is not None


def test_multi_turn_task_with_kl_to_the_reference(model_dir, tmp_path):
    from inflight.tasks import ChainAdditionTask

    task = ChainAdditionTask(max_digits=1, num_eval=20, num_train=100, turns=2)
    cfg, job = rl_config(model_dir, tmp_path, ["trainer.algorithm.use_kl_loss=true",
                                               "trainer.algorithm.kl_loss_coef=0.1", "job.max_steps=3"])
    trainer, history, version, _, _ = _train(cfg, job, task)
    assert version == 3 and trainer.policy.reference is not None
    trained = [r for r in history if r.get("optimizer_steps")]
    assert trained and all("kl" in r for r in trained)


def test_fully_async_with_two_engine_processes(model_dir, tmp_path):
    """Two engines, each in its own process with its own shared-memory receiver: generation is
    spread over both, every sync reaches both, the counters add up over both."""
    from inflight.client.fanout import FanOutClient

    cfg, job = rl_config(model_dir, tmp_path, ["generator.inference_engine.num_engines=2", "job.max_steps=2",
                                               "generator.inference_engine.weight_sync_backend=shm",
                                               "trainer.fully_async.clear_kv_cache_on_weight_sync=true"])

    async def main():
        trainer = make_trainer(cfg, job, small_task())
        try:
            await trainer.setup()
            history = await trainer.train()
            client = trainer.client
            return trainer, history, await client.weight_versions(), await client.engine_stats()
        finally:
            await trainer.close()

    trainer, history, versions, stats = asyncio.run(main())
    assert isinstance(trainer.client, FanOutClient) and len(trainer.client) == 2
    assert versions == {"engine-0": 2, "engine-1": 2} and trainer.global_step == 2
    assert all(s["weight_updates"] == 2 and s["generated_tokens"] > 0 for s in stats.values())
    assert trainer.runtime.engine_procs == [] and trainer.policy.plan.kv_fate == "recompute"
    for r in history:
        assert not [k for k in REQUIRED if k not in r] and r["weight_version"] == r["step"]
    assert sum(r["kv/weight_updates"] for r in history) == 4  # both engines' counters


def test_colocated_sync_trainer_sleeps_and_wakes_every_in_process_engine(model_dir, tmp_path):
    cfg, job = rl_config(model_dir, tmp_path, ["trainer.fully_async.enabled=false", "job.max_steps=2",
                                               "trainer.placement.colocate_all=true",
                                               "generator.inference_engine.num_engines=2"])
    trainer, history, version, _, after = _train(cfg, job, evaluate=True)
    assert len(trainer.client) == 2 and version == 2 and after is not None
    assert [r["staleness_max"] for r in history] == [0.0, 0.0]
    assert trainer.runtime.engines is None  # closed: LocalRuntime.close stops each engine and drops them
