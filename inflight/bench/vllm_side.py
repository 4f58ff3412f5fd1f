"""The benchmark's handle on vLLM: its interpreter (own venv), environment, and worker process.

vLLM lives in its own virtual environment, outside the project's dependencies, so its side of the
benchmark cannot be a spawned copy of this interpreter: `VllmWorker` starts `vllm_worker.py` with
vLLM's python and talks to it in JSON lines (see that module for the protocol).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING, Any

from inflight.backends.vllm.venv import (  # noqa: F401  (the benchmark's names for them)
    DEFAULT_VENV,
    ENV_VAR,
    VllmUnavailable,
    check_python,
    default_python,
    preload_libs,
    setup_commands,
    vllm_env,
)

if TYPE_CHECKING:
    from inflight.bench.engine_workload import BenchConfig, Workload

WORKER_SCRIPT = Path(__file__).with_name("vllm_worker.py")


_COMPILE_MARKERS = (  # vLLM's log lines, first match wins
    ("Compiling model again due to a load failure", "recompiled (cache load failed)"),
    ("Directly load AOT compilation", "loaded from cache"),
    ("saved AOT compiled function", "compiled"),
)
_INIT_LINE = re.compile(r"init engine \(profile, create kv cache, warmup model\) took ([0-9.]+) s")


def log_facts(log: str) -> dict[str, Any]:
    """From vLLM's log: its engine init time (profile, KV cache, warm-up/compile) and the fate of
    the compiled model (`compile`: compiled, loaded from cache, recompiled, or not logged)."""
    init = _INIT_LINE.search(log)
    fate = next((what for marker, what in _COMPILE_MARKERS if marker in log), "not logged")
    return {"engine_init_s": float(init.group(1)) if init else None, "compile": fate}


class VllmWorker:
    """vLLM's side in its own interpreter; `request(op, **fields)` returns the worker's answer.

    The worker's stderr (vLLM's log) goes to a file; its tail is shown when a request fails.
    """

    def __init__(self, python: str, env: dict[str, str] | None = None, dry: bool = False) -> None:
        check_python(python)
        self.log = tempfile.NamedTemporaryFile(prefix="inflight-vllm-", suffix=".log", delete=False)
        args = [python, str(WORKER_SCRIPT), *(["--dry"] if dry else [])]
        self.proc = subprocess.Popen(
            args,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            env=env,
            text=True,
            start_new_session=True,  # its own process group: one signal ends vLLM's processes too
        )
        self.pid = self.proc.pid

    def request(self, op: str, **fields: Any) -> dict[str, Any]:
        """Send one request, wait for its answer; raises RuntimeError with the log's tail on failure."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        try:
            self.proc.stdin.write(json.dumps({"op": op, **fields}) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        except BrokenPipeError:
            line = ""
        if not line:
            raise RuntimeError(f"vLLM worker exited during {op!r} (rc {self.proc.poll()})\n{self.log_tail()}")
        reply = json.loads(line)
        if not reply.pop("ok"):
            raise RuntimeError(
                f"vLLM worker failed in {op!r}: {reply['error']}\n{reply['traceback']}{self.log_tail()}"
            )
        return reply

    def hello(self) -> dict[str, Any]:
        """The handshake; `VllmUnavailable` (with the setup commands) when vLLM does not import."""
        try:
            return self.request("hello")
        except RuntimeError as exc:
            raise VllmUnavailable(
                f"{exc}\nvLLM does not start with {self.proc.args[0]}; (re)create its venv with:\n"
                f"{setup_commands(str(self.proc.args[0]))}"
            ) from None

    def log_text(self) -> str:
        """vLLM's log so far."""
        return Path(self.log.name).read_text(errors="replace")

    def log_tail(self, lines: int = 30) -> str:
        with open(self.log.name, errors="replace") as f:
            return f"--- last lines of {self.log.name}:\n" + "".join(deque(f, maxlen=lines))

    def close(self, timeout_s: float = 60.0) -> int:
        """EOF to the worker, then wait; then its process group (vLLM's processes) is killed, the
        worker too if it did not exit in time."""
        if self.proc.stdin and not self.proc.stdin.closed:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            pass  # the kill below ends it
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.log.close()
        return self.proc.wait()

    def __enter__(self) -> VllmWorker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
        if exc[0] is None:
            os.unlink(self.log.name)
        else:
            print(f"vLLM's log kept at {self.log.name}", file=sys.stderr)


def start_worker(cfg: BenchConfig) -> tuple[VllmWorker, dict[str, Any]]:
    """vLLM's worker with the benchmark's settings, past the handshake: (worker, its record)."""
    python = cfg.vllm_python or default_python()
    env = vllm_env(python, cfg.threads, cfg.vllm_kv_cache_gib, cfg.vllm_env)
    worker = VllmWorker(python, env)
    try:
        hello = worker.hello()
    except VllmUnavailable:
        worker.close(timeout_s=5)
        raise
    shown = {k: v for k, v in env.items() if k.startswith("VLLM_") or k == "LD_PRELOAD"}
    return worker, {"version": hello["vllm"], "import_s": hello["import_s"], "python": python, "env": shown}


def open_model(worker: VllmWorker, cfg: BenchConfig, work: Workload, model_dir: str) -> dict[str, Any]:
    """Load the model there, one full-size warm-up pass: startup, warm-up time, matmul peak, and
    what vLLM's log says about its init and compilation."""
    opened = worker.request(
        "open",
        model_dir=model_dir,
        dtype=cfg.dtype,
        threads=cfg.threads,
        seed=cfg.seed,
        max_num_seqs=cfg.max_num_seqs,
        max_num_batched_tokens=cfg.max_num_batched_tokens,
        prompts=work.prompts,
        output_lens=work.output_lens,
        kwargs={**({} if cfg.block_size is None else {"block_size": cfg.block_size}), **cfg.vllm_kwargs},
    )
    return {**opened, **log_facts(worker.log_text())}


def run_pass(worker: VllmWorker) -> tuple[float, list[list[int]]]:
    """One timed pass: (seconds, output token ids per request)."""
    reply = worker.request("run")
    return reply["seconds"], reply["outputs"]
