"""The command line of an hf_generate server a run starts (its registry entry's `server_command`):
`inflight serve --backend hf_generate` with the few engine settings it takes (model, dtype, seed,
weight version, threads, served name). The engine settings it has no flag for are its entry's
`fixed` keys: a run refuses them set to anything but their defaults before anything starts."""

from __future__ import annotations

from typing import Any

from inflight.backends.serve_command import serve_command
from inflight.engine.config import EngineConfig


def hf_generate_command(cfg: Any, engine: EngineConfig, port: int, *, threads: int,
                        host: str = "127.0.0.1") -> list[str]:
    """`inflight serve --backend hf_generate ...` for `engine` on `host`:`port`."""
    name = cfg.generator.inference_engine.served_model_name
    return serve_command(
        port,
        [
            "--backend", "hf_generate", "--model", engine.model, "--dtype", engine.dtype, "--seed",
            str(engine.seed), "--weight-version", str(engine.weight_version), "--threads", str(threads),
            *(["--served-model-name", name] if name else []),
        ],
        host,
    )
