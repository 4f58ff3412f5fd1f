"""`start_ray`: the runtime of a run with its engines and policy ranks as Ray actors.

Each of the `num_engines` engines is an `EngineActor` and each policy rank a `PolicyActor`, placed
by `make_placement` (colocated or not). The trainer in the driver keeps its loop (generation
workers, staleness manager, buffer, data loader, metrics) and generates through one client over the
engines; the policy ranks train (FSDP over a gloo group when there are several) and rank 0 pushes
the weights to every engine in flight, following the same plan as in one process.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray

from inflight.backends.registry import external, on_servers
from inflight.client.base import InferenceClient
from inflight.cluster.actors import EngineActor, PolicyActor, RayEngineClient, RayPolicy, ServerActor
from inflight.cluster.placement import Placement, make_placement, required_cpus
from inflight.config import Config
from inflight.config.job import JobConfig
from inflight.orchestration.engine_settings import engine_config
from inflight.orchestration.engines import one_client, policy_ranks
from inflight.orchestration.servers import (
    ServerSpec,
    check_backend,
    check_external,
    engine_env,
    external_spec,
    new_control_token,
    server_spec,
)
from inflight.train.checkpoint import CheckpointState


def init_ray(address: str | None = None, object_store_mib: int = 512, num_cpus: int | None = None) -> None:
    """Connect to the Ray cluster at `address`, or start a local instance (small object store) with
    at least `num_cpus` logical CPUs (default: this machine's count), so a job that reserves more
    actors than there are cores still places on a small host."""
    if ray.is_initialized():
        return
    if address:
        ray.init(address=address, include_dashboard=False, log_to_driver=True)
        return
    ray.init(include_dashboard=False, object_store_memory=object_store_mib * 2**20, log_to_driver=True,
             num_cpus=max(os.cpu_count() or 1, num_cpus or 0))


@dataclass
class RayRuntime:
    """The engine actors, the policy actors, their placement, and the driver's views of them."""

    placement: Placement | None
    policy_actors: list[Any] = field(default_factory=list)
    engine_actors: list[Any] = field(default_factory=list)
    # HTTP servers this run started (a backend that runs as servers)
    server_actors: list[Any] = field(default_factory=list)
    servers: ServerSpec | None = None  # the engines are HTTP servers (vLLM, or external_server_urls)
    client: InferenceClient = field(init=False)
    policy: RayPolicy = field(init=False)

    async def close(self) -> None:
        """Stop the actors and release the placement (idempotent)."""
        actors, self.policy_actors = self.policy_actors, []
        engines, self.engine_actors = self.engine_actors, []
        servers, self.server_actors = self.server_actors, []
        if self.servers is not None and hasattr(self, "client"):
            await self.client.close()
        await _stop(actors, "close")  # first: rank 0 tells the engines' receivers to stop
        await _stop(engines, "shutdown")
        await _stop(servers, "shutdown")
        if self.placement is not None:
            self.placement.remove()
            self.placement = None


async def start_ray(cfg: Config, job: JobConfig, *, pad_id: int, model_dir: str | Path, version: int = 0,
                    ckpt: CheckpointState | None = None, training_steps: int | None = None) -> RayRuntime:
    """Start the policy ranks and the engines as actors (Ray started or joined as `job` says) on
    `model_dir` at `version`; on any failure stop what was started and re-raise. With HTTP-server
    engines a `ServerActor` per engine bundle starts each server (or the external servers are
    checked), and the driver and policy rank 0 each reach them through their own `RemoteClient`."""
    ranks = policy_ranks(cfg)
    # in the main thread: Ray installs its signal handlers there
    init_ray(job.ray_address, num_cpus=required_cpus(cfg, job, ranks))
    runtime = RayRuntime(await asyncio.to_thread(make_placement, cfg, job, ranks))
    try:
        runtime.policy_actors = [
            PolicyActor.options(**options).remote(cfg, job, pad_id, str(model_dir), rank, ranks)
            for rank, options in enumerate(runtime.placement.policy_options)
        ]
        lead = runtime.policy_actors[0]
        if on_servers(cfg):
            runtime.servers = await _start_servers(runtime, cfg, job, model_dir, version)
            runtime.client = runtime.servers.client()
        else:
            runtime.engine_actors = await _start_engine_actors(
                cfg, job, lead, runtime.placement, model_dir, version
            )
            runtime.client = one_client([RayEngineClient(a) for a in runtime.engine_actors])
        init_method = await lead.rendezvous.remote() if ranks > 1 else None
        versions = await asyncio.gather(*(
            a.setup.remote(runtime.engine_actors, str(model_dir), version, ckpt, init_method, runtime.servers,
                           training_steps)
            for a in runtime.policy_actors
        ))
        runtime.policy = RayPolicy(runtime.policy_actors, versions[0], await lead.kv_fate.remote())
        if external(cfg):  # servers started elsewhere hold what their owner loaded: the run's weights first
            await runtime.policy.sync_weights()
    except BaseException:
        await runtime.close()
        raise
    return runtime


async def _start_engine_actors(cfg: Config, job: JobConfig, lead: Any, placement: Placement,
                               model_dir: str | Path, version: int) -> list[Any]:
    """One EngineActor per engine, its receiver connected to policy rank 0's (`lead`) transport."""
    device = cfg.generator.inference_engine.device
    options = placement.engine_options
    specs = await asyncio.gather(*(lead.receiver_spec.remote(device, i) for i in range(len(options))))
    return [
        EngineActor.options(**o).remote(engine_config(cfg, model_dir, version, i), job.engine_threads, spec)
        for i, (o, spec) in enumerate(zip(options, specs, strict=True))
    ]


async def _start_servers(runtime: RayRuntime, cfg: Config, job: JobConfig, model_dir: str | Path,
                         version: int) -> ServerSpec:
    """The external servers, checked (`check_external`), or one server of the run's backend per
    engine, each started by a `ServerActor` on its engine's bundle."""
    if external(cfg):
        spec = external_spec(cfg)
        async with spec.client() as client:
            await check_external(client)
        return spec
    check_backend(cfg)
    token, log_dir = new_control_token(), str(Path(cfg.trainer.log_path).resolve() / "servers")
    runtime.server_actors = [ServerActor.options(**o).remote(log_dir, token, engine_env(cfg))
                             for o in runtime.placement.engine_options]
    urls = await asyncio.gather(*(
        actor.start.remote(cfg, engine_config(cfg, model_dir, version, i), job.engine_threads)
        for i, actor in enumerate(runtime.server_actors)
    ))
    return server_spec(cfg, list(urls), token)


async def _stop(actors: list[Any], method: str) -> None:
    """Call `method` on every actor (best effort: they may be dead already), then kill them."""
    await asyncio.gather(*(getattr(a, method).remote() for a in actors), return_exceptions=True)
    for actor in actors:
        ray.kill(actor)
