"""What a trainer runs on: the engines' client and the trained policy, started together.

A runtime holds an `InferenceClient` (the engines, several behind one `FanOutClient`) and a policy
(`train`, `sync_weights`, `save`, `export`, `weight_version`), and stops both with `close()`.
`start_local` starts them in this process tree: the engines in this process for the `inprocess`
weight-sync backend, each in its own child process otherwise, and a `LocalPolicy` of one rank.
With `generator.inference_engine.backend=vllm` or `run_engines_locally=false` the engines are HTTP
servers behind one `RemoteClient` (`inflight.train.servers`), started here or elsewhere; with the
`broadcast` weight sync they join a group the client hosts (`ServerGroupSender`) before the policy loads.
`inflight.cluster.start_ray` starts the same two as Ray actors; the trainers cannot tell them apart.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from inflight.client.base import InferenceClient
from inflight.client.fanout import FanOutClient
from inflight.client.process import EngineProcess, ReceiverSpec
from inflight.config import Config
from inflight.config.implemented import external, on_servers
from inflight.engine.config import EngineConfig
from inflight.engine.step_threads import EngineThreads
from inflight.rollout.task_generator import TrajectoryGroup
from inflight.train.checkpoint import CheckpointState
from inflight.train.engine_settings import engine_config
from inflight.train.job_config import JobConfig
from inflight.train.policy import LocalPolicy
from inflight.train.sender import ServerGroupSender, make_sender, receiver_spec
from inflight.train.servers import Servers, start_servers
from inflight.train.thread_lending import ThreadLending, thread_split
from inflight.train.workers.base import SyncReport
from inflight.weight_sync import configured_transport
from inflight.weight_sync.transport import ChannelTransport, WeightTransport

if TYPE_CHECKING:
    from inflight.engine.async_engine import AsyncEngine


class Policy(Protocol):
    """The trained policy as the trainers see it (`LocalPolicy`, `inflight.cluster.RayPolicy`)."""

    @property
    def weight_version(self) -> int: ...

    async def train(self, groups: list[TrajectoryGroup], policy_version: int) -> dict[str, Any]: ...
    async def sync_weights(self) -> SyncReport: ...
    async def save(self, root: str | Path, step: int, data: dict, extra: dict, keep: int) -> str: ...
    async def export(self, root: str | Path, step: int) -> str: ...


class Runtime(Protocol):
    """The engines' client and the policy of one run; `close()` stops both (idempotent)."""

    client: InferenceClient
    policy: Policy

    async def close(self) -> None: ...


# `start_local` or `inflight.cluster.start_ray`: (cfg, job, *, pad_id, model_dir, version, ckpt) -> Runtime
Starter = Callable[..., Awaitable[Runtime]]


def policy_ranks(cfg: Config) -> int:
    """The policy's ranks: `trainer.placement.policy_num_nodes` x `policy_num_gpus_per_node`."""
    placement = cfg.trainer.placement
    return placement.policy_num_nodes * placement.policy_num_gpus_per_node


def one_client(clients: Sequence[InferenceClient]) -> InferenceClient:
    """The only client, or one `FanOutClient` over several (generation routed, the rest to all)."""
    return clients[0] if len(clients) == 1 else FanOutClient(list(clients))


@dataclass
class LocalRuntime:
    """The engines (in this process or in child processes) and the one-rank policy."""

    transport: WeightTransport | None
    client: InferenceClient = field(init=False)
    policy: LocalPolicy = field(init=False)
    engine_procs: list[EngineProcess] = field(default_factory=list)
    local_engines: list[AsyncEngine] = field(default_factory=list)
    servers: Servers | None = None
    lending: ThreadLending | None = None  # the split of the threads between the policy and the engines

    async def close(self) -> None:
        """Stop the engines and release the transport and the threads' split (idempotent)."""
        if self.transport is not None:
            await asyncio.to_thread(self.transport.close)
            self.transport = None
        servers, self.servers = self.servers, None
        if servers is not None:
            await servers.close()
        procs, self.engine_procs = self.engine_procs, []
        await asyncio.gather(*(asyncio.to_thread(p.close) for p in procs))
        engines, self.local_engines = self.local_engines, []
        await asyncio.gather(*(e.close() for e in engines))
        if self.lending is not None:
            self.lending.close()


async def start_local(cfg: Config, job: JobConfig, *, pad_id: int, model_dir: str | Path, version: int = 0,
                      ckpt: CheckpointState | None = None, training_steps: int | None = None) -> LocalRuntime:
    """Start `generator.inference_engine.num_engines` engines on `model_dir` at `version` and the
    policy (one rank; `training_steps`: the run's, for its learning-rate schedule); servers started
    elsewhere get the policy's weights first (a full sync). On any failure stop what was started and
    re-raise."""
    ranks = policy_ranks(cfg)
    if ranks != 1:
        raise ValueError(f"the policy has {ranks} ranks (trainer.placement.policy_num_nodes x "
                         "policy_num_gpus_per_node); the in-process trainer runs one: "
                         "use --ray (job.ray=true)")
    split = thread_split(cfg, job, engines_here=not on_servers(cfg))
    runtime = LocalRuntime(make_sender(cfg, model_dir, job.trainer_device))
    runtime.lending = lending = split.lending()
    try:
        await _start_engines(runtime, cfg, job, model_dir, version,
                             lambda i: lending.engine_threads(i, split.engine))
        runtime.policy = await asyncio.to_thread(LocalPolicy.load, cfg, job, pad_id, model_dir,
                                                 runtime.client, runtime.transport, version, ckpt, training_steps,
                                                 lending=lending)
        if external(cfg):  # servers started elsewhere hold what their owner loaded: the run's weights first
            await runtime.policy.sync_weights()
    except BaseException:
        await runtime.close()
        raise
    return runtime


async def _start_engines(runtime: LocalRuntime, cfg: Config, job: JobConfig, model_dir: str | Path,
                         version: int, threads: Callable[[int], int | EngineThreads]) -> None:
    """The engines and their client: HTTP servers (vLLM, external), else in this process for
    `inprocess`, in child processes otherwise; engine i of those two computes with `threads(i)`
    torch threads (its own, or its own and those the trainer lends it while it waits)."""
    if on_servers(cfg):
        runtime.servers = await start_servers(cfg, job, model_dir, version)
        runtime.client = runtime.servers.client
        if isinstance(runtime.transport, ServerGroupSender):  # broadcast: the group forms now, not at the first sync
            await runtime.transport.connect(runtime.client)
        return
    ie = cfg.generator.inference_engine
    configs = [engine_config(cfg, model_dir, version, i) for i in range(ie.num_engines)]
    transport = configured_transport(cfg)
    if transport.in_trainer_process:
        from inflight.client import LocalClient
        from inflight.engine import AsyncEngine, LLMEngine

        runtime.local_engines = [AsyncEngine(LLMEngine(c), threads=threads(i)) for i, c in enumerate(configs)]
        runtime.client = one_client([LocalClient(e) for e in runtime.local_engines])
        return
    specs = [receiver_spec(runtime.transport, transport, c.device, i, len(configs)) for i, c in enumerate(configs)]
    runtime.engine_procs = await _start_processes(configs, specs, threads)
    runtime.client = one_client([p.client for p in runtime.engine_procs])
    if isinstance(runtime.transport, ChannelTransport):  # shm and broadcast: a dead engine fails fast
        procs = list(runtime.engine_procs)
        runtime.transport.channel.dead_receivers = lambda: [i + 1 for i, p in enumerate(procs) if not p.alive]
    if transport.forms_group:  # the receivers have started: form their group now, not at the first sync
        await asyncio.to_thread(runtime.transport.connect)


async def _start_processes(configs: Sequence[EngineConfig], specs: Sequence[ReceiverSpec],
                           threads: Callable[[int], int | EngineThreads]) -> list[EngineProcess]:
    """Start one engine process per config, concurrently; on any failure stop the started ones."""
    started = await asyncio.gather(*(asyncio.to_thread(EngineProcess, c, threads(i), s, name=f"engine-{i}")
                                     for i, (c, s) in enumerate(zip(configs, specs, strict=True))),
                                   return_exceptions=True)
    failures = [r for r in started if isinstance(r, BaseException)]
    if failures:
        await asyncio.gather(*(asyncio.to_thread(p.close) for p in started if isinstance(p, EngineProcess)))
        raise failures[0]
    return list(started)
