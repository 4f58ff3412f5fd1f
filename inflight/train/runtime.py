"""What a trainer runs on: the engines' client and the trained policy, started together.

A runtime holds an `InferenceClient` (the engines, several behind one `FanOutClient`) and a policy
(`train`, `sync_weights`, `save`, `export`, `weight_version`), and stops both with `close()`.
`start_local` starts them in this process tree: the engines in this process for the `inprocess`
weight-sync backend, each in its own child process otherwise, and a `LocalPolicy` of one rank.
With `generator.inference_engine.backend=vllm` or `run_engines_locally=false` the engines are HTTP
servers behind one `RemoteClient` (`inflight.orchestration.servers`), started here or elsewhere; with the
`broadcast` weight sync they join a group the client hosts (`ServerGroupSender`) before the policy loads.
`inflight.cluster.start_ray` starts the same two as Ray actors; the trainers cannot tell them apart.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from inflight.backends.registry import external, on_servers
from inflight.client.base import InferenceClient
from inflight.client.process import EngineProcess
from inflight.config import Config
from inflight.config.job import JobConfig
from inflight.orchestration.engines import Engines, form_group, policy_ranks, start_engines
from inflight.orchestration.sender import make_sender
from inflight.orchestration.thread_lending import ThreadLending, thread_split
from inflight.rollout.task_generator import TrajectoryGroup
from inflight.train.checkpoint import CheckpointState
from inflight.train.policy import LocalPolicy
from inflight.train.workers.base import SyncReport
from inflight.weight_sync.transport import WeightTransport


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


@dataclass
class LocalRuntime:
    """The engines (in this process, in child processes or as servers) and the one-rank policy."""

    transport: WeightTransport | None
    client: InferenceClient = field(init=False)
    policy: LocalPolicy = field(init=False)
    engines: Engines | None = None
    lending: ThreadLending | None = None  # the split of the threads between the policy and the engines

    @property
    def engine_procs(self) -> list[EngineProcess]:
        """The engines' child processes (none in this process or as servers): what a restart restarts."""
        return self.engines.procs if self.engines is not None else []

    async def close(self) -> None:
        """Stop the engines and release the transport and the threads' split (idempotent)."""
        if self.transport is not None:
            await asyncio.to_thread(self.transport.close)
            self.transport = None
        engines, self.engines = self.engines, None
        if engines is not None:
            await engines.close()
        if self.lending is not None:
            self.lending.close()


async def start_local(cfg: Config, job: JobConfig, *, pad_id: int, model_dir: str | Path, version: int = 0,
                      ckpt: CheckpointState | None = None, training_steps: int | None = None) -> LocalRuntime:
    """Start `generator.inference_engine.num_engines` engines on `model_dir` at `version`
    (`inflight.orchestration.engines`) and the policy (one rank; `training_steps`: the run's, for
    its learning-rate schedule); servers started elsewhere get the policy's weights first (a full
    sync). On any failure stop what was started and re-raise."""
    ranks = policy_ranks(cfg)
    if ranks != 1:
        raise ValueError(f"the policy has {ranks} ranks (trainer.placement.policy_num_nodes x "
                         "policy_num_gpus_per_node); the in-process trainer runs one: "
                         "use --ray (job.ray=true)")
    split = thread_split(cfg, job, engines_here=not on_servers(cfg))
    runtime = LocalRuntime(make_sender(cfg, model_dir, job.trainer_device))
    runtime.lending = lending = split.lending()
    try:
        runtime.engines = await start_engines(cfg, job, model_dir, version, runtime.transport,
                                              lambda i: lending.engine_threads(i, split.engine))
        runtime.client = runtime.engines.client
        await form_group(cfg, runtime.engines, runtime.transport)
        runtime.policy = await asyncio.to_thread(
            LocalPolicy.load,
            cfg,
            job,
            pad_id,
            model_dir,
            runtime.client,
            runtime.transport,
            version,
            ckpt,
            training_steps,
            lending=lending,
        )
        if external(cfg):  # servers started elsewhere hold what their owner loaded: the run's weights first
            await runtime.policy.sync_weights()
    except BaseException:
        await runtime.close()
        raise
    return runtime
