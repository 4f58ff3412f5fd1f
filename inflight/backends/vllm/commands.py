"""The command line and environment of a vLLM server a run starts (the vLLM entry's
`server_command` and `server_env`), run by the project's interpreter.

One `inflight serve --backend vllm` server per engine, started by this interpreter (so the shim's
own launcher picks vLLM's python); vLLM's own arguments from `engine_init_kwargs` (and
`enforce_eager`; on CUDA `gpu_memory_utilization`, or `kv_cache_memory_gib` as vLLM's
`--kv-cache-memory-bytes`, and sleep mode for colocated engines), its environment from
`vllm_v1_disable_multiproc` (`vllm_args`, `vllm_env`). On CPU the KV cache is
`--kv-cache-memory-gib` of the shim (vLLM's CPU KV space), which the run sizes from
`gpu_memory_utilization` (`orchestration.engine_memory.kv_cache_gib`, in each engine's settings).
"""

from __future__ import annotations

import json
import logging

from inflight.backends.serve_command import serve_command, serve_flags
from inflight.backends.vllm.run_checks import logprobs_mode
from inflight.config import Config, InferenceEngineConfig
from inflight.engine.config import EngineConfig

log = logging.getLogger(__name__)


def vllm_command(engine: EngineConfig, port: int, threads: int = 1, python: str | None = None,
                 host: str = "127.0.0.1", served_model_name: str | None = None,
                 engine_args: list[str] | tuple[str, ...] = ()) -> list[str]:
    """`inflight serve --backend vllm [--vllm-python PY] ... [-- ENGINE_ARGS]` for `engine` on
    `host`:`port` (without PY the shim finds vLLM's python: $INFLIGHT_VLLM_PYTHON, else the repo's
    .venv-vllm); `engine_args` go to vLLM itself."""
    name = ["--served-model-name", served_model_name] if served_model_name else []
    tail = ["--", *engine_args] if engine_args else []
    return serve_command(port, ["--backend", "vllm", *(["--vllm-python", python] if python else []),
                                *serve_flags(engine, threads), *name], host) + tail


def vllm_server_command(cfg: Config, engine: EngineConfig, port: int, *, threads: int,
                        host: str = "127.0.0.1") -> list[str]:
    """The vLLM entry's `server_command`: `vllm_command` with the run's vLLM python, served name and
    vLLM arguments (`vllm_args`: the logprobs mode its sampling needs, sleep mode when colocated)."""
    ie = cfg.generator.inference_engine
    args = vllm_args(ie, sleep_mode=cfg.trainer.placement.colocate_all, logprobs_mode=logprobs_mode(cfg))
    return vllm_command(engine, port, threads, python=ie.vllm_python, host=host,
                        served_model_name=ie.served_model_name, engine_args=args)


def vllm_args(
    ie: InferenceEngineConfig, *, sleep_mode: bool = False, logprobs_mode: str | None = None
) -> list[str]:
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


def vllm_env(cfg: Config) -> dict[str, str]:
    """The vLLM entry's `server_env`: vLLM's engine core in the server's process
    (`vllm_v1_disable_multiproc`). Colocated engines off CUDA: said once in the log that vLLM's sleep
    frees no memory there."""
    ie = cfg.generator.inference_engine
    if cfg.trainer.placement.colocate_all and not ie.device.startswith("cuda"):
        log.warning(
            "trainer.placement.colocate_all=true with vLLM on %s: the engines sleep while the trainer "
            "trains, but vLLM's sleep frees no memory off CUDA (its weights and KV cache stay in host "
            "memory); the engines only stop generating",
            ie.device,
        )
    return {"VLLM_ENABLE_V1_MULTIPROCESSING": "0" if ie.vllm_v1_disable_multiproc else "1"}

