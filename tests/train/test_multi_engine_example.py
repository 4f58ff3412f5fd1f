"""examples/multi_engine.yaml loads and asks for two engines behind one plan, and its Ray variant
with two policy ranks places two ranks and two engines."""

from __future__ import annotations

from pathlib import Path

from inflight.orchestration.engines import policy_ranks
from inflight.train.main import resolve_config
from inflight.weight_sync import plan_weight_sync

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "multi_engine.yaml"


def test_multi_engine_example():
    cfg, job = resolve_config(str(EXAMPLE), [])
    ie = cfg.generator.inference_engine
    assert ie.num_engines == 2 and ie.weight_sync_backend == "shm" and not job.ray
    assert plan_weight_sync(cfg).kv_fate == "keep" and policy_ranks(cfg) == 1
    cfg, job = resolve_config(str(EXAMPLE), ["job.ray=true", "trainer.placement.policy_num_gpus_per_node=2"])
    assert job.ray and policy_ranks(cfg) == 2
