"""A run's engines as HTTP servers behind one `RemoteClient` (a backend whose engines are always
servers, e.g. `generator.inference_engine.backend=vllm` or `hf_generate`, or `run_engines_locally=false`).

- run_engines_locally=true: one server per engine, its command line built by the backend's entry
  (`Backend.server_command`: `inflight serve --backend NAME ...` from the engine's settings), started
  by this interpreter on free 127.0.0.1 ports with a random control token and the entry's
  environment (`Backend.server_env`), logs in `<trainer.log_path>/servers/`; what the backend's
  entry finds wrong with the run (`Backend.problems`: e.g. vLLM's python) is refused first.
- run_engines_locally=false: the servers in `external_server_urls`, with the control token in
  `$INFLIGHT_CONTROL_TOKEN` (the variable `inflight serve` reads; a token never sits in the config,
  which the run writes to config.yaml and the trackers). Each must answer /health and all must be
  at one weight version; the run then pushes its own weights to them before the first rollout
  (they were started with whatever model their owner gave them).

Weights travel through the client either way: with `weight_sync_backend=shm` as safetensors chunk
files in /dev/shm that the servers (on this host) read, with `inprocess` in request bodies, with
`broadcast` (SkyRL's nccl / gloo) in a weight group the client hosts, each server a member
(`inflight.orchestration.sender.ServerGroupSender`); by the same plan and executor as every other
engine (`LocalPolicy.sync_weights`). Colocated engines (`colocate_all`) sleep while the trainer trains.
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from inflight.backends.registry import backend_of
from inflight.client.remote import RemoteClient
from inflight.config import Config, ConfigError
from inflight.config.implemented import require_implemented
from inflight.config.job import JobConfig
from inflight.orchestration.engine_settings import engine_config
from inflight.orchestration.server_fleet import CommandFor, ServerFleet
from inflight.weight_sync import configured_transport

CONTROL_TOKEN_ENV = "INFLIGHT_CONTROL_TOKEN"


def engine_env(cfg: Config) -> dict[str, str]:
    """The environment of the servers a run starts: CUDA's expandable segments
    (`use_expandable_segments`) and the backend entry's own (`Backend.server_env`)."""
    ie = cfg.generator.inference_engine
    env = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"} if ie.use_expandable_segments else {}
    return {**env, **backend_of(cfg).server_environment(cfg)}


def server_commands(cfg: Config, job: JobConfig, model_dir: str | Path, version: int) -> list[CommandFor]:
    """The command line of each server the run starts on 127.0.0.1, given its port: the backend
    entry's `server_command` over each engine's `engine_config` (the KV size per engine from
    `engine_memory.kv_cache_gib`)."""
    entry = backend_of(cfg)
    return [
        partial(entry.server_argv, cfg, engine_config(cfg, model_dir, version, i), threads=job.engine_threads)
        for i in range(cfg.generator.inference_engine.num_engines)
    ]


def check_backend(cfg: Config) -> None:
    """What the backend's entry finds wrong with a run on its servers (`Backend.problems`: e.g.
    vLLM's python), as one ConfigError, before anything starts."""
    problems = backend_of(cfg).problems(cfg)
    if problems:
        raise ConfigError(problems)


@dataclass(frozen=True)
class ServerSpec:
    """How any process of the run reaches its servers (the driver, policy rank 0 under Ray)."""

    urls: list[str]
    control_token: str | None
    # weight chunks as /dev/shm files (the transport's chunk_files: shm), else request bodies
    shm_chunks: bool

    def client(self) -> RemoteClient:
        return RemoteClient(self.urls, control_token=self.control_token, shm_chunks=self.shm_chunks)


def server_spec(cfg: Config, urls: list[str], control_token: str | None) -> ServerSpec:
    """The spec of servers at `urls` for `cfg`'s weight transport."""
    return ServerSpec(list(urls), control_token, configured_transport(cfg).chunk_files)


def external_spec(cfg: Config) -> ServerSpec:
    """The spec of the servers in `external_server_urls`, with the token from `CONTROL_TOKEN_ENV`."""
    return server_spec(cfg, cfg.generator.inference_engine.external_server_urls or [],
                       os.environ.get(CONTROL_TOKEN_ENV))


@dataclass
class Servers:
    """The servers' client, and the fleet when this run started them (None: started elsewhere)."""

    client: RemoteClient
    fleet: ServerFleet | None = None

    async def close(self) -> None:
        """Close the client's connections and stop the servers this run started (idempotent)."""
        try:
            await self.client.close()
        finally:
            if self.fleet is not None:
                await self.fleet.close()


async def start_servers(cfg: Config, job: JobConfig, model_dir: str | Path, version: int) -> Servers:
    """The run's servers and their client (see the module docstring); raises, leaving nothing
    running, when one does not start or answer."""
    require_implemented(cfg)
    ie = cfg.generator.inference_engine
    if not ie.run_engines_locally:
        client = external_spec(cfg).client()
        try:
            await check_external(client)
        except BaseException:
            await client.close()
            raise
        return Servers(client)
    check_backend(cfg)
    token = new_control_token()
    fleet = ServerFleet(
        Path(cfg.trainer.log_path) / "servers", env={CONTROL_TOKEN_ENV: token, **engine_env(cfg)}
    )
    urls = await fleet.start(server_commands(cfg, job, model_dir, version), backend_of(cfg).start_timeout_s)
    return Servers(server_spec(cfg, urls, token).client(), fleet)


def new_control_token() -> str:
    """A random control token for servers this run starts (they read it from `CONTROL_TOKEN_ENV`)."""
    return secrets.token_urlsafe(24)


async def check_external(client: RemoteClient) -> None:
    """Every server answers /health and all are at one weight version."""
    await client.health()  # raises ServerUnavailableError / RemoteError naming the server
    versions = await client.weight_versions()
    if len(set(versions.values())) > 1:
        raise ValueError(
            f"the servers in generator.inference_engine.external_server_urls are at different weight "
            f"versions {versions}: restart them at one version (inflight serve --weight-version N)"
        )
