"""`inflight serve --backend vllm`, on the project's side: find vLLM's interpreter, set its
environment, and exec the backend's entry script (`main.py`) with it.

Project-side options (read here): `--vllm-python` (default `$INFLIGHT_VLLM_PYTHON`, else
`.venv-vllm/bin/python`), `--threads` (CPU threads vLLM binds, default every CPU this process may
use), `--kv-cache-memory-gib` (vLLM's CPU KV cache, `VLLM_CPU_KVCACHE_SPACE`, default 1). The rest
of the command line goes to the backend (see `server.build_parser`; after `--`, to vLLM itself).
The process is replaced (exec): its pid is the server's, and a signal to it reaches vLLM.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from inflight.backends.vllm.venv import VllmUnavailable, check_python, default_python, vllm_env

ENTRY_SCRIPT = Path(__file__).with_name("main.py")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--backend", default="vllm")
    p.add_argument("--vllm-python", default=None)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--kv-cache-memory-gib", type=float, default=1.0)
    return p


def command(argv: list[str]) -> tuple[list[str], dict[str, str]]:
    """The backend's command line and environment for `argv` (raises VllmUnavailable)."""
    ours, rest = build_parser().parse_known_args(argv)
    python = ours.vllm_python or default_python()
    check_python(python)
    threads = ours.threads or len(os.sched_getaffinity(0))
    env = vllm_env(python, threads, ours.kv_cache_memory_gib)
    env.pop("PYTHONPATH", None)  # the project's paths must not leak into vLLM's interpreter
    # a weight reload sends a function to vLLM's worker (weights.repack_vocabulary): vLLM's own
    # IPC between its processes on this host may then carry pickled callables
    env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    return [python, str(ENTRY_SCRIPT), *rest], env


def main(argv: list[str]) -> int:
    """Exec the vLLM backend; returns 2 (with the setup commands) when vLLM's python is missing."""
    try:
        args, env = command(argv)
    except VllmUnavailable as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(args[0], args, env)
    return 1  # not reached
