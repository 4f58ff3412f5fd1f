"""Ray actors: an inference engine (`EngineActor`) and the trained policy (`PolicyActor`), and the
InferenceClient that drives an engine actor (`RayEngineClient`).

The engine actor is an async actor holding an AsyncEngine; every client call is one actor call
(`apply_op`, the same dispatch the engine process uses). Weights go from the policy actor to the
engine actor through the configured transport (`shm` on one node, `broadcast` across nodes) whose
receiver runs in a thread of the engine actor; with `inprocess` they travel as actor-call
arguments through Ray's object store (the slow path).
"""

from __future__ import annotations

import asyncio
import os
import uuid
from pathlib import Path
from typing import Any

import ray
import torch

from inflight.config import Config
from inflight.engine.config import EngineConfig
from inflight.train.checkpoint import CheckpointState
from inflight.train.engine_process import OpClient, ReceiverSpec, apply_op, start_receiver
from inflight.train.generator import TrajectoryGroup
from inflight.train.job_config import JobConfig
from inflight.train.policy import LocalPolicy


class RayEngineClient(OpClient):
    """InferenceClient over an `EngineActor` handle (usable from the driver and from other actors)."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle

    async def _call(self, op: str, *args: Any, **kwargs: Any) -> Any:
        return await self.handle.call.remote(op, args, kwargs)


@ray.remote
class EngineActor:
    """One inference engine; weights arrive through `receiver` (None: through `load_weights` calls)."""

    def __init__(self, config: EngineConfig, threads: int = 1, receiver: ReceiverSpec | None = None) -> None:
        torch.set_num_threads(threads)
        from inflight.engine import AsyncEngine, LLMEngine

        self.engine = AsyncEngine(LLMEngine(config))
        start_receiver(self.engine, receiver)

    async def call(self, op: str, args: tuple = (), kwargs: dict | None = None) -> Any:
        return await apply_op(self.engine, op, args, kwargs)

    async def shutdown(self) -> None:
        await self.engine.close()

    def pid(self) -> int:
        return os.getpid()


@ray.remote
class PolicyActor:
    """The policy worker, training step, dispatch and the weight transport's sending side."""

    def __init__(self, cfg: Config, job: JobConfig, pad_id: int, chunk_bytes: int) -> None:
        torch.set_num_threads(job.threads)
        self.cfg, self.job = cfg, job
        self.policy = LocalPolicy(cfg, job, pad_id)
        backend = cfg.generator.inference_engine.weight_sync_backend
        self.transport: Any = None
        if backend == "shm":
            from inflight.train.trainer import SHM_DIR, SHM_PREFIX, remove_stale_shm_buffers
            from inflight.weight_sync import ShmTransport

            remove_stale_shm_buffers()
            path = SHM_DIR / f"{SHM_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}"
            self.transport = ShmTransport(host=_node_ip(), max_chunk_bytes=chunk_bytes, path=str(path))
        elif backend == "broadcast":
            from inflight.weight_sync import BroadcastTransport

            self.transport = BroadcastTransport(host=_node_ip(), max_chunk_bytes=chunk_bytes,
                                                device=job.trainer_device)
        else:
            from inflight.weight_sync import InProcessTransport

            self.transport = InProcessTransport()

    def receiver_spec(self, engine_device: str) -> ReceiverSpec | None:
        """Where the engine actor's receiver connects (None for `inprocess`)."""
        kind = self.cfg.generator.inference_engine.weight_sync_backend
        if kind == "inprocess":
            return None
        return ReceiverSpec(kind, self.transport.channel.host, self.transport.port, engine_device)

    async def setup(self, engine: Any, model_dir: str, base_model_dir: str, version: int,
                    ckpt: CheckpointState | None) -> int:
        client = RayEngineClient(engine)
        if self.cfg.generator.inference_engine.weight_sync_backend == "broadcast":
            await asyncio.to_thread(self.transport.connect)
        await asyncio.to_thread(self.policy.setup, model_dir, base_model_dir, client, self.transport, version, ckpt)
        return self.policy.weight_version

    def kv_fate(self) -> str:
        return self.policy.kv_fate

    async def train(self, groups: list[TrajectoryGroup], policy_version: int) -> dict[str, Any]:
        return await self.policy.train(groups, policy_version)

    async def sync(self) -> dict[str, Any]:
        return await self.policy.sync()

    async def save(self, root: str, step: int, data: dict, extra: dict, keep: int) -> str:
        return await self.policy.save(root, step, data, extra, keep)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()
            self.transport = None


def _node_ip() -> str:
    """This node's address as Ray knows it (127.0.0.1 when everything is local)."""
    try:
        address = ray.util.get_node_ip_address()
    except Exception:
        return "127.0.0.1"
    return address or "127.0.0.1"


class RayPolicy:
    """The driver's view of a `PolicyActor`: the same `train` / `sync` / `save` / `weight_version`
    as `LocalPolicy` (the version is cached here and updated by each sync)."""

    def __init__(self, actor: Any, version: int, kv_fate: str) -> None:
        self.actor, self._version, self.kv_fate = actor, version, kv_fate

    @property
    def weight_version(self) -> int:
        return self._version

    async def train(self, groups: list[TrajectoryGroup], policy_version: int) -> dict[str, Any]:
        return await self.actor.train.remote(groups, policy_version)

    async def sync(self) -> dict[str, Any]:
        report = await self.actor.sync.remote()
        self._version = int(report["version"])
        return report

    async def save(self, root: str | Path, step: int, data: dict, extra: dict, keep: int) -> str:
        return await self.actor.save.remote(str(root), step, data, extra, keep)
