"""The trainers with their engines and policy ranks as Ray actors.

`RayFullyAsyncTrainer` / `RaySyncTrainer` are the in-process trainers with one change: each of the
`num_engines` engines is an `EngineActor` and each policy rank a `PolicyActor`, placed by
`make_placement` (colocated or not). The driver keeps the loop (generation workers, staleness
manager, buffer, data loader, metrics) and generates through a `FanOutClient` over the engines;
the policy ranks train (FSDP over a gloo group when there are several) and rank 0 pushes the
weights to every engine in flight, following the same plan.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import ray

from inflight.client.fanout import FanOutClient
from inflight.cluster.actors import EngineActor, PolicyActor, RayEngineClient, RayPolicy
from inflight.cluster.placement import Placement, make_placement, required_cpus
from inflight.config import Config
from inflight.tasks.base import Task
from inflight.train.engine_settings import engine_config
from inflight.train.job_config import JobConfig
from inflight.train.trainer import FullyAsyncTrainer, RLTrainer, SyncTrainer, policy_ranks


def init_ray(address: str | None = None, object_store_mib: int = 512, num_cpus: int | None = None) -> None:
    """Connect to the Ray cluster at `address`, or start a local instance (small object store) with
    at least `num_cpus` logical CPUs (default: this machine's count), so a job that reserves more
    actors than there are cores still places on a small host."""
    if ray.is_initialized():
        return
    if address:
        ray.init(address=address, include_dashboard=False, log_to_driver=True)
        return
    cpus = max(os.cpu_count() or 1, num_cpus or 0)
    ray.init(
        include_dashboard=False,
        object_store_memory=object_store_mib * 2**20,
        log_to_driver=True,
        num_cpus=cpus,
    )


class RayTrainerMixin:
    """Replaces the engine processes and the local policy by Ray actors."""

    placement: Placement | None = None
    engine_actors: list[Any]
    policy_actors: list[Any]

    def _check_policy_ranks(self: Any) -> None:
        """Any number of ranks: each is an actor."""

    async def _setup_engine_and_policy(self: Any, model_dir: str | Path, version: int, ckpt) -> None:
        cfg, job = self.cfg, self.job
        ranks = policy_ranks(cfg)
        # in the main thread: Ray installs its signal handlers there
        init_ray(job.ray_address, num_cpus=required_cpus(cfg, job, ranks))
        self.placement = await asyncio.to_thread(make_placement, cfg, job, ranks)
        self.policy_actors = [
            PolicyActor.options(**options).remote(cfg, job, self._pad_id(), str(model_dir), rank, ranks)
            for rank, options in enumerate(self.placement.policy_options)
        ]
        self.engine_actors = await self._start_engine_actors(model_dir, version)
        clients = [RayEngineClient(a) for a in self.engine_actors]
        self.client = clients[0] if len(clients) == 1 else FanOutClient(clients)
        lead = self.policy_actors[0]
        init_method = await lead.rendezvous.remote() if ranks > 1 else None
        versions = await asyncio.gather(
            *(
                a.setup.remote(
                    self.engine_actors, str(model_dir), str(self.base_model_dir), version, ckpt, init_method
                )
                for a in self.policy_actors
            )
        )
        self.policy = RayPolicy(self.policy_actors, versions[0], await lead.kv_fate.remote())

    async def _start_engine_actors(self: Any, model_dir: str | Path, version: int) -> list[Any]:
        """One EngineActor per engine, its receiver connected to policy rank 0's transport."""
        device = self.cfg.generator.inference_engine.device
        options = self.placement.engine_options
        specs = await asyncio.gather(
            *(self.policy_actors[0].receiver_spec.remote(device, i) for i in range(len(options)))
        )
        return [
            EngineActor.options(**o).remote(
                engine_config(self.cfg, model_dir, version, i), self.job.engine_threads, spec
            )
            for i, (o, spec) in enumerate(zip(options, specs, strict=True))
        ]

    async def close(self: Any) -> None:
        actors, self.policy_actors = getattr(self, "policy_actors", []), []
        engines, self.engine_actors = getattr(self, "engine_actors", []), []
        await _stop(actors, "close")  # first: rank 0 tells the engines' receivers to stop
        await _stop(engines, "shutdown")
        if self.placement is not None:
            self.placement.remove()
            self.placement = None
        await RLTrainer.close(self)


async def _stop(actors: list[Any], method: str) -> None:
    """Call `method` on every actor (best effort: they may be dead already), then kill them."""
    await asyncio.gather(*(getattr(a, method).remote() for a in actors), return_exceptions=True)
    for actor in actors:
        ray.kill(actor)


class RayFullyAsyncTrainer(RayTrainerMixin, FullyAsyncTrainer):
    mode = "fully_async"


class RaySyncTrainer(RayTrainerMixin, SyncTrainer):
    mode = "sync"


def make_ray_trainer(cfg: Config, job: JobConfig, task: Task, **kwargs: Any) -> RLTrainer:
    """`RayFullyAsyncTrainer` when `trainer.fully_async.enabled`, else `RaySyncTrainer`."""
    cls = RayFullyAsyncTrainer if cfg.trainer.fully_async.enabled else RaySyncTrainer
    return cls(cfg, job, task, **kwargs)
