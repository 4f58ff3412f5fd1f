"""A run's engines as HTTP servers behind one `RemoteClient` (`generator.inference_engine.backend=vllm`,
or `run_engines_locally=false`).

- backend=vllm, run_engines_locally=true: one `inflight serve --backend vllm` server per engine,
  started by this interpreter (so the shim's own launcher picks vLLM's python), on free
  127.0.0.1 ports with a random control token, logs in `<trainer.log_path>/servers/`; vLLM's own
  arguments from `engine_init_kwargs` (and `enforce_eager`; on CUDA `gpu_memory_utilization`, or
  `kv_cache_memory_gib` as vLLM's `--kv-cache-memory-bytes`, and sleep mode for colocated engines),
  its environment from `vllm_v1_disable_multiproc` and `use_expandable_segments` (`vllm_args`,
  `engine_env`). On CPU the KV cache is `--kv-cache-memory-gib` of the shim (vLLM's CPU KV space),
  which the run sizes from `gpu_memory_utilization` (`engine_memory.kv_cache_gib`).
- run_engines_locally=false: the servers in `external_server_urls`, with the control token in
  `$INFLIGHT_CONTROL_TOKEN` (the variable `inflight serve` reads; a token never sits in the config,
  which the run writes to config.yaml and the trackers). Each must answer /health and all must be
  at one weight version; the run then pushes its own weights to them before the first rollout
  (they were started with whatever model their owner gave them).

Weights travel through the client either way: with `weight_sync_backend=shm` as safetensors chunk
files in /dev/shm that the servers (on this host) read, with `inprocess` in request bodies, with
`broadcast` (SkyRL's nccl / gloo) in a weight group the client hosts, each server a member
(`inflight.orchestration.sender.ServerGroupSender`); by the same plan and executor as every other engine
(`LocalPolicy.sync_weights`). Colocated engines (`colocate_all`) sleep while the trainer trains:
on CUDA through vLLM's sleep mode, on CPU without freeing memory (vLLM's sleep is CUDA-only; the
run says so once in its log).
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from inflight.client.remote import RemoteClient
from inflight.config import Config, ConfigError, InferenceEngineConfig
from inflight.config.implemented import backend, require_implemented
from inflight.config.job import JobConfig
from inflight.engine.config import EngineConfig
from inflight.orchestration.engine_settings import engine_config
from inflight.orchestration.server_fleet import ServerFleet
from inflight.weight_sync import configured_transport

log = logging.getLogger(__name__)
CONTROL_TOKEN_ENV = "INFLIGHT_CONTROL_TOKEN"
_NATIVE_ONLY_DEFAULTS = {"attention_backend": "auto", "linear_backend": "auto", "elementwise_backend": "auto",
                         "enable_chunked_prefill": True, "weight_update_rollback": True}


def serve_flags(engine: EngineConfig, threads: int) -> list[str]:
    """`inflight serve` flags for `engine`'s settings that the server command line carries (host,
    port and token are the launcher's)."""
    flags = ["--model", engine.model, "--device", engine.device, "--dtype", engine.dtype,
             "--max-num-seqs", str(engine.max_num_seqs), "--max-num-batched-tokens", str(engine.max_num_batched_tokens),
             "--kv-cache-memory-gib", str(engine.kv_cache_memory_gib), "--seed", str(engine.seed),
             "--weight-version", str(engine.weight_version), "--threads", str(threads),
             "--weight-update-timeout-s", str(engine.weight_update_timeout_s or 0)]
    flags += ["--max-model-len", str(engine.max_model_len)] if engine.max_model_len is not None else []
    flags += [] if engine.enable_prefix_caching else ["--no-prefix-caching"]
    return flags


def native_command(engine: EngineConfig, port: int, threads: int = 1) -> list[str]:
    """`inflight serve` (the native engine) for `engine` on 127.0.0.1:`port`. The settings the
    server's command line lacks must be at their defaults (raises ValueError naming them)."""
    lacking = [k for k, d in _NATIVE_ONLY_DEFAULTS.items() if getattr(engine, k) != d]
    if lacking:
        raise ValueError(f"`inflight serve` has no flag for {lacking}: leave them at their defaults for a server")
    flags = serve_flags(engine, threads) + ["--block-size", str(engine.block_size)]
    flags += ["--num-kv-blocks", str(engine.num_kv_blocks)] if engine.num_kv_blocks is not None else []
    return _serve(port, flags)


def vllm_command(engine: EngineConfig, port: int, threads: int = 1, python: str | None = None,
                 host: str = "127.0.0.1", served_model_name: str | None = None,
                 engine_args: list[str] | tuple[str, ...] = ()) -> list[str]:
    """`inflight serve --backend vllm [--vllm-python PY] ... [-- ENGINE_ARGS]` for `engine` on
    `host`:`port` (without PY the shim finds vLLM's python: $INFLIGHT_VLLM_PYTHON, else the repo's
    .venv-vllm); `engine_args` go to vLLM itself."""
    name = ["--served-model-name", served_model_name] if served_model_name else []
    tail = ["--", *engine_args] if engine_args else []
    return _serve(port, ["--backend", "vllm", *(["--vllm-python", python] if python else []),
                         *serve_flags(engine, threads), *name], host) + tail


def vllm_args(ie: InferenceEngineConfig, *, sleep_mode: bool = False, logprobs_mode: str | None = None) -> list[str]:
    """vLLM's command-line arguments for `engine_init_kwargs` (each `name: value` as `--name-with-dashes
    value`; true as the bare flag, false as `--no-name`, mappings and lists as JSON) and
    `enforce_eager`; on CUDA also the KV memory (`gpu_memory_utilization` as vLLM's, or
    `kv_cache_memory_gib` as `--kv-cache-memory-bytes`, unless `engine_init_kwargs` has
    `kv_cache_memory_bytes`) and, with `sleep_mode` (colocated engines), `--enable-sleep-mode`. On
    CPU neither: the shim's `--kv-cache-memory-gib` sets vLLM's CPU KV space, and vLLM has no sleep mode.
    `logprobs_mode` (the run's: `backends.vllm.run_checks.logprobs_mode`) as `--logprobs-mode` unless
    `engine_init_kwargs` sets it."""
    args: list[str] = ["--enforce-eager"] if ie.enforce_eager else []
    if logprobs_mode is not None and "logprobs_mode" not in ie.engine_init_kwargs:
        args += ["--logprobs-mode", logprobs_mode]
    if ie.device.startswith("cuda"):
        if "kv_cache_memory_bytes" not in ie.engine_init_kwargs:
            args += (["--kv-cache-memory-bytes", str(int(ie.kv_cache_memory_gib * 2**30))]
                     if ie.kv_cache_memory_gib is not None else
                     ["--gpu-memory-utilization", str(ie.gpu_memory_utilization)])
        if sleep_mode and "enable_sleep_mode" not in ie.engine_init_kwargs:
            args.append("--enable-sleep-mode")
    for name, value in ie.engine_init_kwargs.items():
        flag = "--" + str(name).replace("_", "-")
        if value is True:
            args.append(flag)
        elif value is False:
            args.append("--no-" + flag[2:])
        elif value is not None:
            args += [flag, json.dumps(value) if isinstance(value, dict | list) else str(value)]
    return args


def engine_env(ie: InferenceEngineConfig) -> dict[str, str]:
    """The environment of the engines' processes: vLLM's engine core in the server's process
    (`vllm_v1_disable_multiproc`) and CUDA's expandable segments (`use_expandable_segments`)."""
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0" if ie.vllm_v1_disable_multiproc else "1"}
    if ie.use_expandable_segments:
        env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    return env


def _serve(port: int, flags: list[str], host: str = "127.0.0.1") -> list[str]:
    return [sys.executable, "-m", "inflight.cli", "serve", *flags, "--host", host, "--port", str(port)]


@dataclass(frozen=True)
class ServerSpec:
    """How any process of the run reaches its servers (the driver, policy rank 0 under Ray)."""

    urls: list[str]
    control_token: str | None
    shm_chunks: bool  # weight chunks as /dev/shm files (the transport's chunk_files: shm), else request bodies

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
    check_vllm_python(ie.vllm_python)
    token = new_control_token()
    fleet = ServerFleet(Path(cfg.trainer.log_path) / "servers", env={CONTROL_TOKEN_ENV: token, **engine_env(ie)})
    if cfg.trainer.placement.colocate_all and not ie.device.startswith("cuda"):
        log.warning("trainer.placement.colocate_all=true with vLLM on %s: the engines sleep while the trainer "
                    "trains, but vLLM's sleep frees no memory off CUDA (its weights and KV cache stay in host "
                    "memory); the engines only stop generating", ie.device)
    urls = await fleet.start(vllm_commands(cfg, job, model_dir, version), backend(cfg).start_timeout_s)
    return Servers(server_spec(cfg, urls, token).client(), fleet)


def vllm_commands(cfg: Config, job: JobConfig, model_dir: str | Path, version: int) -> list[Callable[[int], list[str]]]:
    """The command line of each vLLM server the run starts, given its port (`vllm_command` over each
    engine's `engine_config`: the KV size per engine from `engine_memory.kv_cache_gib`)."""
    from inflight.backends.vllm.run_checks import logprobs_mode

    ie = cfg.generator.inference_engine
    args = vllm_args(ie, sleep_mode=cfg.trainer.placement.colocate_all, logprobs_mode=logprobs_mode(cfg))
    return [partial(vllm_command, engine_config(cfg, model_dir, version, i), threads=job.engine_threads,
                    python=ie.vllm_python, served_model_name=ie.served_model_name, engine_args=args)
            for i in range(ie.num_engines)]


def new_control_token() -> str:
    """A random control token for servers this run starts (they read it from `CONTROL_TOKEN_ENV`)."""
    return secrets.token_urlsafe(24)


def check_vllm_python(python: str | None) -> None:
    """vLLM's python (`python`, else $INFLIGHT_VLLM_PYTHON or .venv-vllm) must be an executable file
    (ConfigError naming the key and the command that creates it: `backends.vllm.venv.python_problem`)."""
    from inflight.backends.vllm.venv import python_problem

    problem = python_problem(python)
    if problem is not None:
        raise ConfigError([problem])


async def check_external(client: RemoteClient) -> None:
    """Every server answers /health and all are at one weight version."""
    await client.health()  # raises ServerUnavailableError / RemoteError naming the server
    versions = await client.weight_versions()
    if len(set(versions.values())) > 1:
        raise ValueError(f"the servers in generator.inference_engine.external_server_urls are at different weight "
                         f"versions {versions}: restart them at one version (inflight serve --weight-version N)")
