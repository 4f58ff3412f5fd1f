"""`inflight serve` command lines for the servers a run starts: the flags an `EngineConfig` becomes
(`serve_flags`, which every backend's server shares or picks from), the command around them
(`serve_command`) and the native engine's (`native_command`, its entry's `server_command`).

Each backend's entry names its own builder (`Backend.server_command`); the launcher
(`inflight.orchestration.servers`) calls it with the run's config, one engine's settings, a port,
the engine's threads and the host to bind, and never looks at the backend's name.
"""

from __future__ import annotations

import sys
from typing import Any

from inflight.engine.config import EngineConfig

_NATIVE_ONLY_DEFAULTS = {"attention_backend": "auto", "linear_backend": "auto", "elementwise_backend": "auto",
                         "enable_chunked_prefill": True, "weight_update_rollback": True}


def serve_flags(engine: EngineConfig, threads: int) -> list[str]:
    """`inflight serve` flags for `engine`'s settings that the server command line carries (host,
    port and token are the launcher's)."""
    flags = [
        "--model", engine.model, "--device", engine.device, "--dtype", engine.dtype, "--max-num-seqs",
        str(engine.max_num_seqs), "--max-num-batched-tokens", str(engine.max_num_batched_tokens),
        "--kv-cache-memory-gib", str(engine.kv_cache_memory_gib), "--seed", str(engine.seed),
        "--weight-version", str(engine.weight_version), "--threads", str(threads),
        "--weight-update-timeout-s", str(engine.weight_update_timeout_s or 0),
    ]
    flags += ["--max-model-len", str(engine.max_model_len)] if engine.max_model_len is not None else []
    flags += [] if engine.enable_prefix_caching else ["--no-prefix-caching"]
    return flags


def serve_command(port: int, flags: list[str], host: str = "127.0.0.1") -> list[str]:
    """`inflight serve FLAGS --host HOST --port PORT`, run by this interpreter."""
    return [sys.executable, "-m", "inflight.cli", "serve", *flags, "--host", host, "--port", str(port)]


def native_command(engine: EngineConfig, port: int, threads: int = 1, host: str = "127.0.0.1") -> list[str]:
    """`inflight serve` (the native engine) for `engine` on `host`:`port`. The settings the server's
    command line lacks must be at their defaults (raises ValueError naming them)."""
    lacking = [k for k, d in _NATIVE_ONLY_DEFAULTS.items() if getattr(engine, k) != d]
    if lacking:
        raise ValueError(
            f"`inflight serve` has no flag for {lacking}: leave them at their defaults for a server"
        )
    flags = serve_flags(engine, threads) + ["--block-size", str(engine.block_size)]
    flags += ["--num-kv-blocks", str(engine.num_kv_blocks)] if engine.num_kv_blocks is not None else []
    return serve_command(port, flags, host)


def native_server_command(cfg: Any, engine: EngineConfig, port: int, *, threads: int,
                          host: str = "127.0.0.1") -> list[str]:
    """The native entry's `server_command`: `native_command` (the config adds nothing to it)."""
    return native_command(engine, port, threads, host)
