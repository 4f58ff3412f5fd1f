"""Placement of the policy and engine actors: one placement group, colocated or not.

Not colocated: two bundles, the policy's (`job.threads` CPUs, a GPU when `job.trainer_device` is
CUDA) and the engine's (`job.engine_threads` CPUs, a GPU when the engine's device is CUDA), packed
on one node when the weights go through shared memory (`shm`), spread freely otherwise. Colocated
(`trainer.placement.colocate_all`): one bundle that both actors share (half a GPU each on CUDA).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from inflight.config import Config
from inflight.train.job_config import JobConfig


@dataclass
class Placement:
    group: Any
    policy_options: dict[str, Any]
    engine_options: dict[str, Any]

    def remove(self) -> None:
        remove_placement_group(self.group)


def _is_cuda(device: str) -> bool:
    return device.startswith("cuda")


def make_placement(cfg: Config, job: JobConfig, timeout_s: float = 120.0) -> Placement:
    """Reserve the resources of one policy and one engine actor; returns the actor options."""
    engine_device = cfg.generator.inference_engine.device
    policy_gpu = 1 if _is_cuda(job.trainer_device) else 0
    engine_gpu = 1 if _is_cuda(engine_device) else 0
    if cfg.trainer.placement.colocate_all:
        gpus = max(policy_gpu, engine_gpu)
        bundles = [{"CPU": max(job.threads, job.engine_threads), **({"GPU": gpus} if gpus else {})}]
        share = {"num_cpus": bundles[0]["CPU"] / 2, "num_gpus": gpus / 2}
        policy, engine = dict(share, bundle=0), dict(share, bundle=0)
    else:
        bundles = [{"CPU": job.threads, **({"GPU": 1} if policy_gpu else {})},
                   {"CPU": job.engine_threads, **({"GPU": 1} if engine_gpu else {})}]
        policy = {"num_cpus": job.threads, "num_gpus": policy_gpu, "bundle": 0}
        engine = {"num_cpus": job.engine_threads, "num_gpus": engine_gpu, "bundle": 1}
    same_node = cfg.generator.inference_engine.weight_sync_backend == "shm"
    group = placement_group(bundles, strategy="STRICT_PACK" if same_node else "PACK")
    ray.get(group.ready(), timeout=timeout_s)

    def options(spec: dict[str, Any]) -> dict[str, Any]:
        strategy = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=spec["bundle"])
        return {"num_cpus": spec["num_cpus"], "num_gpus": spec["num_gpus"], "scheduling_strategy": strategy}

    return Placement(group, options(policy), options(engine))
