"""Placement of the policy ranks and the engines: one placement group, colocated or not.

Not colocated: one bundle per policy rank (`job.threads` CPUs, a GPU when `job.trainer_device` is
CUDA) and one per engine (`job.engine_threads` CPUs, a GPU when the engine's device is CUDA; an
engine actor or the `ServerActor` of a vLLM server; none for servers started elsewhere).
Colocated (`trainer.placement.colocate_all`): max(ranks, engines) shared bundles; policy rank i and
engine i sit on bundle i and split its resources. The group is packed on one node when the weights
go through shared memory (`shm`), spread freely otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from inflight.backends.registry import external
from inflight.config import Config
from inflight.config.job import JobConfig
from inflight.orchestration.engines import policy_ranks
from inflight.weight_sync import configured_transport


@dataclass
class Placement:
    """The reserved group and the actor options of each policy rank and each engine."""

    group: Any
    bundles: list[dict[str, float]]
    policy_options: list[dict[str, Any]]
    engine_options: list[dict[str, Any]]

    def remove(self) -> None:
        remove_placement_group(self.group)


def _spec(bundle: int, cpus: float, gpus: float) -> dict[str, Any]:
    return {"bundle": bundle, "num_cpus": cpus, "num_gpus": gpus}


def plan_bundles(cfg: Config, job: JobConfig, num_policy: int | None = None
                 ) -> tuple[list[dict], list[dict], list[dict]]:
    """(bundles, policy specs, engine specs): what `make_placement` reserves, without Ray.
    `num_policy`: policy ranks (default: `policy_ranks(cfg)`)."""
    num_policy = num_policy or policy_ranks(cfg)
    # elsewhere: nothing to hold
    num_engines = 0 if external(cfg) else cfg.generator.inference_engine.num_engines
    policy_gpu = 1 if job.trainer_device.startswith("cuda") else 0
    engine_gpu = 1 if cfg.generator.inference_engine.device.startswith("cuda") else 0
    if not cfg.trainer.placement.colocate_all:
        bundles = [_bundle(job.threads, policy_gpu)] * num_policy
        bundles += [_bundle(job.engine_threads, engine_gpu)] * num_engines
        policy = [_spec(i, job.threads, policy_gpu) for i in range(num_policy)]
        engines = [_spec(num_policy + i, job.engine_threads, engine_gpu) for i in range(num_engines)]
        return bundles, policy, engines
    size = max(num_policy, num_engines)
    gpus = max(policy_gpu, engine_gpu)
    bundles = [_bundle(max(job.threads, job.engine_threads), gpus)] * size
    sharing = [(i < num_policy) + (i < num_engines) for i in range(size)]  # actors on bundle i

    def share(i: int) -> dict[str, Any]:
        return _spec(i, bundles[i]["CPU"] / sharing[i], gpus / sharing[i])

    return bundles, [share(i) for i in range(num_policy)], [share(i) for i in range(num_engines)]


def _bundle(cpus: int, gpus: int) -> dict[str, float]:
    return {"CPU": cpus, **({"GPU": gpus} if gpus else {})}


def required_cpus(cfg: Config, job: JobConfig, num_policy: int | None = None) -> int:
    """CPUs the placement group reserves (a local Ray instance is started with at least these)."""
    return int(sum(b["CPU"] for b in plan_bundles(cfg, job, num_policy)[0]))


def placement_strategy(cfg: Config) -> str:
    """Ray's strategy for the run's bundles: all on one node where the weight transport needs its
    receivers on the sender's host (`same_node`: shm), else packed where they fit."""
    return "STRICT_PACK" if configured_transport(cfg).same_node else "PACK"


def make_placement(
    cfg: Config, job: JobConfig, num_policy: int | None = None, timeout_s: float = 120.0
) -> Placement:
    """Reserve the resources of `num_policy` policy ranks and `num_engines` engines."""
    bundles, policy, engines = plan_bundles(cfg, job, num_policy)
    group = placement_group(bundles, strategy=placement_strategy(cfg))
    try:
        ray.get(group.ready(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError as err:
        remove_placement_group(group)
        raise RuntimeError(f"the Ray cluster cannot place {bundles} within {timeout_s:.0f} s "
                           f"(available: {ray.available_resources()})") from err

    def options(spec: dict[str, Any]) -> dict[str, Any]:
        strategy = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=spec["bundle"])
        return {"num_cpus": spec["num_cpus"], "num_gpus": spec["num_gpus"], "scheduling_strategy": strategy}

    return Placement(group, bundles, [options(s) for s in policy], [options(s) for s in engines])
