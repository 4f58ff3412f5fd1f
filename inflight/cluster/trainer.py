"""The trainers with their engine and policy as Ray actors.

`RayFullyAsyncTrainer` / `RaySyncTrainer` are the in-process trainers with one change: the engine
is an `EngineActor` and the policy a `PolicyActor`, placed by `make_placement`. The driver keeps
the loop (generation workers, staleness manager, buffer, data loader, metrics); the policy actor
trains and pushes the weights to the engine actor in flight, following the same plan.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import ray

from inflight.cluster.actors import EngineActor, PolicyActor, RayEngineClient, RayPolicy
from inflight.cluster.placement import Placement, make_placement
from inflight.config import Config
from inflight.tasks.base import Task
from inflight.train.job_config import JobConfig
from inflight.train.trainer import FullyAsyncTrainer, RLTrainer, SyncTrainer, _chunk_bytes, engine_config


def init_ray(address: str | None = None, object_store_mib: int = 512) -> None:
    """Connect to the Ray cluster at `address`, or start a local instance (small object store)."""
    if ray.is_initialized():
        return
    if address:
        ray.init(address=address, include_dashboard=False, log_to_driver=True)
    else:
        ray.init(include_dashboard=False, object_store_memory=object_store_mib * 2**20, log_to_driver=True)


class RayTrainerMixin:
    """Replaces the engine process and the local policy by Ray actors."""

    placement: Placement | None = None
    engine_actor: Any = None
    policy_actor: Any = None

    async def _setup_engine_and_policy(self: Any, model_dir: str | Path, version: int, ckpt) -> None:
        cfg, job = self.cfg, self.job
        init_ray(job.ray_address)  # in the main thread: Ray installs its signal handlers there
        self.placement = await asyncio.to_thread(make_placement, cfg, job)
        self.policy_actor = PolicyActor.options(**self.placement.policy_options).remote(
            cfg, job, self._pad_id(), _chunk_bytes(model_dir)
        )
        spec = await self.policy_actor.receiver_spec.remote(cfg.generator.inference_engine.device)
        self.engine_actor = EngineActor.options(**self.placement.engine_options).remote(
            engine_config(cfg, model_dir, version), job.engine_threads, spec
        )
        self.client = RayEngineClient(self.engine_actor)
        version = await self.policy_actor.setup.remote(
            self.engine_actor, str(model_dir), str(self.base_model_dir), version, ckpt
        )
        self.policy = RayPolicy(self.policy_actor, version, await self.policy_actor.kv_fate.remote())

    async def close(self: Any) -> None:
        if self.policy_actor is not None:
            try:
                await self.policy_actor.close.remote()
            finally:
                ray.kill(self.policy_actor)
                self.policy_actor = None
        if self.engine_actor is not None:
            try:
                await self.engine_actor.shutdown.remote()
            finally:
                ray.kill(self.engine_actor)
                self.engine_actor = None
        if self.placement is not None:
            self.placement.remove()
            self.placement = None
        await RLTrainer.close(self)


class RayFullyAsyncTrainer(RayTrainerMixin, FullyAsyncTrainer):
    mode = "fully_async"


class RaySyncTrainer(RayTrainerMixin, SyncTrainer):
    mode = "sync"


def make_ray_trainer(cfg: Config, job: JobConfig, task: Task, **kwargs: Any) -> RLTrainer:
    """`RayFullyAsyncTrainer` when `trainer.fully_async.enabled`, else `RaySyncTrainer`."""
    cls = RayFullyAsyncTrainer if cfg.trainer.fully_async.enabled else RaySyncTrainer
    return cls(cfg, job, task, **kwargs)
