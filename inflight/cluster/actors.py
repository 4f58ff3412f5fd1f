"""Ray actors: an inference engine (`EngineActor`), a vLLM server (`ServerActor`) and one rank of the
trained policy (`PolicyActor`); the InferenceClient that drives an engine actor is `RayEngineClient`
(`inflight.client.process`: only how an operation travels is Ray's, one actor `call`).

The engine actor is an async actor holding an AsyncEngine; every client call is one actor call
(`apply_op`, the same dispatch the engine process uses). Weights go from policy rank 0 to every
engine actor through the configured transport (`shm` on one node, `broadcast` across nodes) whose
receivers run in a thread of each engine actor; with `inprocess` they travel as actor-call
arguments through Ray's object store (the slow path). Several engines are driven through one
`FanOutClient`, so a sync is the same plan executed once against all of them.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

import ray
import torch

from inflight.backends.registry import backend_of
from inflight.client.ops import apply_op
from inflight.client.process import RayEngineClient, ReceiverSpec, start_receiver
from inflight.config import Config
from inflight.config.job import JobConfig
from inflight.engine import AsyncEngine, LLMEngine
from inflight.engine.config import EngineConfig
from inflight.orchestration.engines import one_client
from inflight.orchestration.sender import make_sender, receiver_spec
from inflight.orchestration.server_fleet import ServerFleet, free_port
from inflight.orchestration.servers import CONTROL_TOKEN_ENV, ServerSpec
from inflight.rollout.task_generator import TrajectoryGroup
from inflight.train.checkpoint import CheckpointState
from inflight.train.policy import LocalPolicy, ensure_process_group
from inflight.train.workers.base import SyncReport
from inflight.weight_sync import configured_transport
from inflight.weight_sync.transport import ChannelTransport, WeightTransport


@ray.remote
class EngineActor:
    """One inference engine; weights arrive through `receiver` (None: through `load_weights` calls)."""

    def __init__(self, config: EngineConfig, threads: int = 1, receiver: ReceiverSpec | None = None) -> None:
        torch.set_num_threads(threads)
        self.engine = AsyncEngine(LLMEngine(config))
        start_receiver(self.engine, receiver)

    async def call(self, op: str, *args: Any) -> Any:
        """One client operation (`RayEngineClient`'s channel)."""
        return await apply_op(self.engine, op, *args)

    async def shutdown(self) -> None:
        await self.engine.close()

    def pid(self) -> int:
        return os.getpid()


@ray.remote
class ServerActor:
    """One HTTP inference server (the command its backend's entry builds, e.g. `inflight serve
    --backend vllm`) on this actor's node, holding the CPUs (and GPU) of an engine's bundle; the
    server dies with the actor (`ServerFleet`)."""

    def __init__(self, log_dir: str, control_token: str, env: dict[str, str] | None = None) -> None:
        self.fleet = ServerFleet(
            log_dir, env={CONTROL_TOKEN_ENV: control_token, **(env or {})}, host=_node_ip()
        )

    async def start(self, cfg: Config, engine: EngineConfig, threads: int) -> str:
        """Start the server of `cfg`'s backend for `engine` (`Backend.server_command`) and wait for its
        /health; returns its URL (this node's address)."""
        entry = backend_of(cfg)
        command = partial(entry.server_argv, cfg, engine, threads=threads, host=self.fleet.host)
        (url,) = await self.fleet.start([command], entry.start_timeout_s)
        return url

    async def shutdown(self) -> None:
        await self.fleet.close()


@ray.remote
class PolicyActor:
    """One rank of the policy (a `LocalPolicy`: its worker, the training step and the weight sync);
    rank 0 also holds the weight transport's sending side and the client of every engine. With
    several ranks they form one torch.distributed group (gloo on CPU, nccl on CUDA) at rank 0's
    `rendezvous()`."""

    def __init__(self, cfg: Config, job: JobConfig, pad_id: int, model_dir: str, rank: int = 0,
                 world_size: int = 1) -> None:
        torch.set_num_threads(job.threads)
        if world_size > 1 and job.worker not in ("auto", "fsdp", "megatron"):
            raise ValueError(f"job.worker={job.worker!r} cannot train on {world_size} ranks: use fsdp")
        self.cfg, self.job, self.pad_id, self.rank, self.world_size = cfg, job, pad_id, rank, world_size
        self.policy: LocalPolicy | None = None
        self.transport: WeightTransport | None = None
        if rank == 0:  # only rank 0 talks to the engines
            self.transport = make_sender(cfg, model_dir, job.trainer_device, host=_node_ip())

    def receiver_spec(self, engine_device: str, index: int = 0) -> ReceiverSpec | None:
        """Where engine `index`'s receiver connects (None for a transport without one: `inprocess`);
        rank 0 only."""
        transport = configured_transport(self.cfg)
        if transport.in_trainer_process:
            return None
        engines = self.cfg.generator.inference_engine.num_engines
        return receiver_spec(self.transport, transport, engine_device, index, engines)

    def rendezvous(self) -> str:
        """The init method of the policy ranks' process group, on rank 0's node."""
        return f"tcp://{_node_ip()}:{free_port(_node_ip())}"

    async def setup(self, engines: list[Any], model_dir: str, version: int, ckpt: CheckpointState | None,
                    init_method: str | None = None, servers: ServerSpec | None = None,
                    training_steps: int | None = None) -> int:
        """Join the ranks' group (blocks until every rank has), load the worker; rank 0 drives
        `engines` (EngineActor handles) through one client, or the HTTP `servers`."""
        if self.world_size > 1:
            await asyncio.to_thread(ensure_process_group, self.job.trainer_device, init_method, self.rank,
                                    self.world_size)
        client = None
        if self.rank == 0 and servers is not None:
            client = servers.client()
        elif self.rank == 0:
            client = one_client([RayEngineClient(e) for e in engines])
            if isinstance(self.transport, ChannelTransport):  # a dead engine actor fails a sync at once
                self.transport.channel.dead_receivers = lambda: [i + 1 for i in dead_actors(engines)]
            if configured_transport(self.cfg).forms_group:
                await asyncio.to_thread(self.transport.connect)
        self.policy = await asyncio.to_thread(
            LocalPolicy.load, self.cfg, self.job, self.pad_id, model_dir, client, self.transport, version,
            ckpt, training_steps,
        )
        return self.policy.weight_version

    def describe(self) -> dict[str, Any]:
        """This rank's place, worker, and the rows and forward/backward passes it has trained on."""
        worker = self.policy.worker
        return {"rank": worker.rank, "world_size": worker.world_size, "worker": type(worker).__name__,
                "pid": os.getpid(), **self.policy.step_fn.counts}

    def kv_fate(self) -> str:
        return self.policy.kv_fate

    async def call(self, method: str, *args: Any) -> Any:
        """This rank's part of one `LocalPolicy` call (`train` on its share of the whole step,
        `sync_weights`, `save`, `export`; rank 0's answer is the call's): `RayPolicy`'s channel."""
        return await getattr(self.policy, method)(*args)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()
            self.transport = None


PING_S = 0.5  # how long `dead_actors` waits for an answer (a busy actor that answers later is alive)


def dead_actors(actors: Sequence[Any], timeout_s: float = PING_S) -> list[int]:
    """The indices of the actors (EngineActor handles) whose process is gone: Ray answers a call
    to a dead actor with `RayActorError` (an actor that does not answer within `timeout_s` counts
    as alive). Blocking: call it from a thread, e.g. a transport's wait for an acknowledgement."""
    refs = [a.pid.remote() for a in actors]
    done = set(ray.wait(refs, num_returns=len(refs), timeout=timeout_s)[0])
    return [i for i, ref in enumerate(refs) if ref in done and _died(ref)]


def _died(ref: Any) -> bool:
    try:
        ray.get(ref)
    except ray.exceptions.RayActorError:
        return True
    return False


def _node_ip() -> str:
    """This node's address as Ray knows it (127.0.0.1 when everything is local)."""
    try:
        address = ray.util.get_node_ip_address()
    except Exception:
        return "127.0.0.1"
    return address or "127.0.0.1"


class RayPolicy:
    """The driver's view of the `PolicyActor` ranks: the same `train` / `sync_weights` / `save` /
    `weight_version` / `kv_fate` as `LocalPolicy`. Every call goes to every rank at once (they meet in
    collectives) and answers with rank 0's result; the version is cached here, updated by each sync.

    Data parallel: the step's groups go into the object store once and every rank reads them;
    each trains on its own share of every mini-batch (`inflight.train.data_parallel`: the ranks
    need the whole step for the global advantages, token counts and mini-batches), and the
    averaged gradient equals the one-rank step's. Rank 0's metrics cover the whole step."""

    def __init__(self, actors: Sequence[Any], version: int, kv_fate: str) -> None:
        self.actors = list(actors)
        self._version, self.kv_fate = version, kv_fate

    @property
    def weight_version(self) -> int:
        return self._version

    async def _all(self, method: str, *args: Any) -> Any:
        results = await asyncio.gather(*(a.call.remote(method, *args) for a in self.actors))
        return results[0]

    async def train(self, groups: list[TrajectoryGroup], policy_version: int) -> dict[str, Any]:
        shared = ray.put(groups) if len(self.actors) > 1 else groups  # serialised once for all ranks
        return await self._all("train", shared, policy_version)

    async def sync_weights(self) -> SyncReport:
        """One weight sync on every rank; rank 0's report."""
        report = await self._all("sync_weights")
        self._version = report.version
        return report

    async def save(self, root: str | Path, step: int, data: dict, extra: dict, keep: int) -> str:
        return await self._all("save", str(root), step, data, extra, keep)

    async def export(self, root: str | Path, step: int) -> str:
        return await self._all("export", str(root), step)
