"""Starting `inflight serve --backend vllm` for the vLLM tests (a module of its own, not the conftest,
so that `from vllm_launch import ...` names one module whatever other conftest pytest loaded first)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import torch

from inflight.backends.vllm.venv import default_python, setup_commands

REPO = Path(__file__).resolve().parents[3]
TOKEN = "vllm-test-control"
# head_dim 64; big enough that a vLLM step outlasts the frontend's work per step: with a model
# faster than its own frontend, vLLM's output loop never yields and a pause waits for the backlog
TINY = dict(
    hidden_size=512, num_attention_heads=8, num_key_value_heads=2, intermediate_size=1024, num_hidden_layers=4
)
START_TIMEOUT_S = 300


@dataclass
class VllmServer:
    url: str
    models: dict[str, Path]  # tag -> model dir
    hf: dict[str, torch.nn.Module]
    weights: dict[str, dict[str, torch.Tensor]]
    log: Path
    token: str = TOKEN


def vllm_python_or_skip() -> str:
    python = default_python()
    if not (Path(python).is_file() and os.access(python, os.X_OK)):
        pytest.skip(f"vLLM's python not found at {python} (set INFLIGHT_VLLM_PYTHON, or create it: "
                    f"scripts/vllm_venv.sh; by hand:\n{setup_commands(python)})")
    return python


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(path: Path, lines: int = 40) -> str:
    with open(path, errors="replace") as f:
        return "".join(deque(f, maxlen=lines))


def _wait_ready(url: str, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the vLLM server exited (rc {proc.returncode}):\n{_tail(log)}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the vLLM server did not answer /health within {START_TIMEOUT_S} s:\n{_tail(log)}")


@contextlib.contextmanager
def launch(model: Path, args: list[str]) -> Iterator[tuple[str, Path]]:
    """`python -m inflight.server --backend vllm --model MODEL ARGS` on a free port until the block
    ends (its process group stopped); yields (url, log file)."""
    python = vllm_python_or_skip()
    port = _free_port()
    log = Path(tempfile.mkstemp(prefix="inflight-vllm-test-", suffix=".log")[1])
    argv = [sys.executable, "-m", "inflight.server", "--backend", "vllm", "--vllm-python", python,
            "--model", str(model), "--port", str(port), "--threads", "1", "--kv-cache-memory-gib", "1",
            "--log-level", "warning", *args]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(url, proc, log)
        yield url, log
    finally:
        for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
            try:
                os.killpg(proc.pid, sig)
                proc.wait(wait)
                break
            except (ProcessLookupError, subprocess.TimeoutExpired):
                continue
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # vLLM's engine and worker processes, if any is left
        except ProcessLookupError:
            pass
        print(f"vLLM server log: {log}", file=sys.stderr)
