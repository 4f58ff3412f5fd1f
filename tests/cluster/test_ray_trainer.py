"""Through Ray: the engines and the policy ranks as actors (placement group, local Ray instance), a
short fully-async run for each KV fate with a real engine, and one with two engines and two
data-parallel FSDP ranks; its metrics file holds every field."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest

ray = pytest.importorskip("ray", reason="ray is not installed: pip install torch==2.13.0 -e '.[ray]'")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "train"))
from rl_support import rl_config, small_task, warm_model_dir  # noqa: E402

from inflight.cluster import init_ray, start_ray  # noqa: E402
from inflight.train.trainer import FullyAsyncTrainer, SyncTrainer, make_trainer  # noqa: E402

REQUIRED = ("reward", "accuracy", "staleness_mean", "staleness_max", "is_ratio_mean", "kv/resets",
            "kv/recomputed_tokens", "timing/wait_s", "timing/train_s", "timing/sync_s", "timing/pause_s",
            "throughput/tokens_per_s")

FATES = {
    "keep": ["generator.inference_engine.weight_sync_backend=shm"],
    "offload": ["generator.inference_engine.weight_sync_backend=shm",
                "generator.inference_engine.offload_kv_for_weight_sync=true"],
    "recompute": ["generator.inference_engine.weight_sync_backend=broadcast",
                  "trainer.fully_async.clear_kv_cache_on_weight_sync=true"],
}


@pytest.fixture(scope="module")
def ray_cluster():
    init_ray(object_store_mib=256, num_cpus=4)  # room for 2 policy ranks + 2 engines
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return warm_model_dir(tmp_path_factory)


def _run(cfg, job):
    async def main():
        trainer = make_trainer(cfg, job, small_task(), start=start_ray)
        try:
            await trainer.setup()
            history = await trainer.train()
            two = len(trainer.runtime.engine_actors) > 1
            trainer.versions = await trainer.client.weight_versions() if two else None
            trainer.ranks = [await a.describe.remote() for a in trainer.runtime.policy_actors]
            return trainer, history, await trainer.client.weight_version()
        finally:
            await trainer.close()

    return asyncio.run(main())


@pytest.mark.parametrize("fate", list(FATES))
def test_fully_async_through_ray(ray_cluster, model_dir, tmp_path, fate):
    cfg, job = rl_config(model_dir, tmp_path, FATES[fate] + ["job.max_steps=3", "job.ray=true"])
    trainer, history, version = _run(cfg, job)
    assert isinstance(trainer, FullyAsyncTrainer) and trainer.policy.kv_fate == fate
    assert version == 3 == trainer.global_step
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    for r in records:
        assert not [k for k in REQUIRED if k not in r]
        assert r["weight_version"] == r["step"]
    assert trainer.runtime.engine_actors == [] and trainer.runtime.placement is None  # released


def test_sync_through_ray_with_weights_through_the_object_store(ray_cluster, model_dir, tmp_path):
    cfg, job = rl_config(model_dir, tmp_path, ["trainer.fully_async.enabled=false", "job.max_steps=2",
                                               "job.ray=true"])  # weight_sync_backend=inprocess
    trainer, history, version = _run(cfg, job)
    assert isinstance(trainer, SyncTrainer) and version == 2
    assert all(r["staleness_max"] == 0 for r in history)


def test_two_engines_and_two_fsdp_ranks_through_ray(ray_cluster, model_dir, tmp_path):
    """Generation spread over two engine actors, two policy actors training as one FSDP group over
    gloo, each on its share of every step (data parallel), every sync reaching both engines through
    the broadcast group (1 sender, 2 receivers)."""
    cfg, job = rl_config(model_dir, tmp_path, FATES["recompute"] + [
        "generator.inference_engine.num_engines=2", "trainer.placement.policy_num_gpus_per_node=2",
        "job.max_steps=2", "job.ray=true"])
    trainer, history, version = _run(cfg, job)
    assert version == 2 == trainer.global_step and trainer.versions == {"engine-0": 2, "engine-1": 2}
    assert [(r["rank"], r["world_size"], r["worker"]) for r in trainer.ranks] == [
        (0, 2, "FSDPPolicyWorker"), (1, 2, "FSDPPolicyWorker")]
    trained = sum(r["groups_trained"] for r in history) * cfg.generator.n_samples_per_prompt
    rows = [r["trained_rows"] for r in trainer.ranks]
    assert sum(rows) == trained and trainer.ranks[0]["passes"] == trainer.ranks[1]["passes"]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    for r in records:
        assert not [k for k in REQUIRED if k not in r]
        assert r["weight_version"] == r["step"] and r["kv/weight_updates"] == 2  # both engines
    assert trainer.runtime.policy_actors == [] and trainer.runtime.placement is None
