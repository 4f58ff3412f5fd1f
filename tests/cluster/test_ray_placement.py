"""Placement of policy ranks and engines: the bundles reserved and which actor sits on which bundle,
colocated or not (computed without starting Ray)."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("ray", reason="ray is not installed: pip install torch==2.13.0 -e '.[ray]'")

from inflight.cluster import plan_bundles, policy_ranks, required_cpus  # noqa: E402
from inflight.config import load_config  # noqa: E402
from inflight.config.job import JobConfig  # noqa: E402
from inflight.testing import LOCAL_CPU


def _cfg(*overrides: str):
    return load_config(None, [*LOCAL_CPU, "trainer.fully_async.enabled=false", *overrides])


def test_not_colocated_gives_each_rank_and_engine_its_own_bundle():
    cfg = _cfg("generator.inference_engine.num_engines=3")
    bundles, policy, engines = plan_bundles(cfg, JobConfig(threads=2, engine_threads=1), num_policy=2)
    assert bundles == [{"CPU": 2}, {"CPU": 2}, {"CPU": 1}, {"CPU": 1}, {"CPU": 1}]
    assert [p["bundle"] for p in policy] == [0, 1] and [e["bundle"] for e in engines] == [2, 3, 4]
    assert all(p["num_cpus"] == 2 for p in policy) and all(e["num_cpus"] == 1 for e in engines)
    assert required_cpus(cfg, JobConfig(threads=2, engine_threads=1), 2) == 7


def test_colocated_puts_rank_i_and_engine_i_on_bundle_i_and_splits_it():
    cfg = _cfg(
        "trainer.placement.colocate_all=true",
        "generator.inference_engine.num_engines=3",
        "trainer.placement.policy_num_gpus_per_node=3",  # SkyRL: one engine per policy rank on GPUs
        "generator.inference_engine.device=cuda",
    )
    job = JobConfig(threads=2, engine_threads=2, trainer_device="cuda")
    bundles, policy, engines = plan_bundles(cfg, job, num_policy=2)
    assert bundles == [{"CPU": 2, "GPU": 1}] * 3
    assert [(p["bundle"], p["num_cpus"], p["num_gpus"]) for p in policy] == [(0, 1.0, 0.5), (1, 1.0, 0.5)]
    assert [(e["bundle"], e["num_gpus"]) for e in engines] == [(0, 0.5), (1, 0.5), (2, 1.0)]


def test_policy_ranks_come_from_the_placement_keys():
    assert policy_ranks(_cfg()) == 1
    cfg = _cfg("trainer.placement.policy_num_nodes=2", "trainer.placement.policy_num_gpus_per_node=3")
    assert policy_ranks(cfg) == 6 and required_cpus(cfg, JobConfig()) == 7  # with one engine


def test_the_in_process_trainer_refuses_several_policy_ranks(tmp_path):
    from inflight.tasks import AdditionTask
    from inflight.train.trainer import make_trainer

    cfg = _cfg("trainer.placement.policy_num_gpus_per_node=2", f"trainer.policy.model.path={tmp_path}")
    trainer = make_trainer(cfg, JobConfig(output_dir=str(tmp_path)), AdditionTask(num_train=10, num_eval=2))
    with pytest.raises(ValueError, match="use --ray"):
        asyncio.run(trainer.setup())
