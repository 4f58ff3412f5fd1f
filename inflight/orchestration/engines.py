"""A run's engines started in this process tree, and their one client.

`start_engines` starts `generator.inference_engine.num_engines` engines for `start_local`
(`inflight.train.runtime`): HTTP servers behind one `RemoteClient` where the engines are servers
(a backend that runs only as servers, or `run_engines_locally=false`: `inflight.orchestration.servers`),
else in this process for a transport whose engines live in the trainer's process (`inprocess`),
else each in its own child process with its weight receiver. With a transport that forms a group
`form_group` forms it once the receivers (or servers) have started, not at the first sync.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from inflight.backends.registry import on_servers
from inflight.client.base import InferenceClient
from inflight.client.fanout import FanOutClient
from inflight.client.process import EngineProcess, ReceiverSpec
from inflight.config import Config
from inflight.config.job import JobConfig
from inflight.engine.config import EngineConfig
from inflight.engine.step_threads import EngineThreads
from inflight.orchestration.engine_settings import engine_config
from inflight.orchestration.sender import ServerGroupSender, receiver_spec
from inflight.orchestration.servers import Servers, start_servers
from inflight.weight_sync import configured_transport
from inflight.weight_sync.transport import ChannelTransport, WeightTransport

if TYPE_CHECKING:
    from inflight.engine.async_engine import AsyncEngine


def policy_ranks(cfg: Config) -> int:
    """The policy's ranks: `trainer.placement.policy_num_nodes` x `policy_num_gpus_per_node`."""
    placement = cfg.trainer.placement
    return placement.policy_num_nodes * placement.policy_num_gpus_per_node


def one_client(clients: Sequence[InferenceClient]) -> InferenceClient:
    """The only client, or one `FanOutClient` over several (generation routed, the rest to all)."""
    return clients[0] if len(clients) == 1 else FanOutClient(list(clients))


@dataclass
class Engines:
    """The engines of a run started here (in this process, in child processes, or as servers) and
    their one `client`; `close()` stops them (idempotent)."""

    client: InferenceClient
    procs: list[EngineProcess] = field(default_factory=list)
    local: list[AsyncEngine] = field(default_factory=list)
    servers: Servers | None = None

    async def close(self) -> None:
        """Stop the servers, the engine processes and the in-process engines (idempotent)."""
        servers, self.servers = self.servers, None
        if servers is not None:
            await servers.close()
        procs, self.procs = self.procs, []
        await asyncio.gather(*(asyncio.to_thread(p.close) for p in procs))
        engines, self.local = self.local, []
        await asyncio.gather(*(e.close() for e in engines))


async def start_engines(cfg: Config, job: JobConfig, model_dir: str | Path, version: int,
                        sender: WeightTransport | None,
                        threads: Callable[[int], int | EngineThreads]) -> Engines:
    """The engines on `model_dir` at `version` and their client, their receivers reaching `sender`
    (policy rank 0's side, `inflight.orchestration.sender.make_sender`); engine i in this process or
    a child computes with `threads(i)` torch threads (its own, or its own and those the trainer lends
    it while it waits). On any failure the engines already started are stopped."""
    if on_servers(cfg):
        servers = await start_servers(cfg, job, model_dir, version)
        return Engines(servers.client, servers=servers)
    ie = cfg.generator.inference_engine
    configs = [engine_config(cfg, model_dir, version, i) for i in range(ie.num_engines)]
    transport = configured_transport(cfg)
    if transport.in_trainer_process:
        from inflight.client import LocalClient
        from inflight.engine import AsyncEngine, LLMEngine

        local = [AsyncEngine(LLMEngine(c), threads=threads(i)) for i, c in enumerate(configs)]
        return Engines(one_client([LocalClient(e) for e in local]), local=local)
    specs = [receiver_spec(sender, transport, c.device, i, len(configs)) for i, c in enumerate(configs)]
    procs = await _start_processes(configs, specs, threads)
    engines = Engines(one_client([p.client for p in procs]), procs=procs)
    if isinstance(sender, ChannelTransport):  # shm and broadcast: a dead engine fails fast
        sender.channel.dead_receivers = lambda: [i + 1 for i, p in enumerate(procs) if not p.alive]
    return engines


async def form_group(cfg: Config, engines: Engines, sender: WeightTransport | None) -> None:
    """With a transport that forms a group, form it now that its members have started (the servers
    join the group their client hosts: `ServerGroupSender`), not at the first sync."""
    if isinstance(sender, ServerGroupSender):
        await sender.connect(engines.client)
    elif engines.procs and configured_transport(cfg).forms_group:
        await asyncio.to_thread(sender.connect)


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
