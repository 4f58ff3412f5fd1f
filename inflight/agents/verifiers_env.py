"""verifiers environments (`environment.env_class=verifiers:<env id>`), as an agent of the agent endpoint.

verifiers cannot share the project's venv (its releases pin their own openai, datasets and more), so
it lives in its own, `.venv-verifiers` (`scripts/verifiers_venv.sh`; `$INFLIGHT_VERIFIERS_PYTHON`
names another interpreter), where the environment's package is installed too. There a worker
(`verifiers_worker.py`, which imports no inflight) loads the environment once per run with
`verifiers.load_environment(env_id, **environment.verifiers)` and plays each episode it is sent.
On this side `VerifiersAgent` is an agent like any other (`agent(base_url, api_key, problem)`): it
sends the episode's session (its base_url and key) and the problem's row to the worker, whose
environment runs its rollout against that endpoint (every call recorded token for token, merged
into the trajectory as for any agent) and scores it with its rubric: that is the reward, and the
rubric's reward functions' values are kept in the episode's info (`verifiers_metrics`).

The rows are `data.train_data` / `data.val_data` as for any run; the environment's own datasets
become such files with the worker's `dataset` command (`dataset_command`): its `verifiers` column
(example id, task, info) goes back to the environment with each episode's prompt and answer.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import json
import logging
import os
from pathlib import Path
from typing import Any

import inflight
from inflight.agents.agent import AgentError, AgentStopped

log = logging.getLogger(__name__)
WORKER = Path(__file__).with_name("verifiers_worker.py")
DEFAULT_VENV = Path(inflight.__file__).resolve().parents[1] / ".venv-verifiers"
ENV_VAR = "INFLIGHT_VERIFIERS_PYTHON"
VERSION = "0.1.8.post2"
"""The verifiers release scripts/verifiers_venv.sh installs (the legacy API SkyRL's integration drives)."""


class VerifiersError(AgentError):
    """The verifiers environment cannot be started or used; the message says what to do."""


def default_python() -> str:
    """`$INFLIGHT_VERIFIERS_PYTHON`, else the repository's `.venv-verifiers/bin/python`."""
    return os.environ.get(ENV_VAR) or str(DEFAULT_VENV / "bin" / "python")


def check_python(python: str) -> None:
    """Raise `VerifiersError` (with the setup commands) unless `python` is an executable file."""
    if not (Path(python).is_file() and os.access(python, os.X_OK)):
        raise VerifiersError(
            f"verifiers' python not found at {python} (set ${ENV_VAR} to name another). verifiers lives in "
            "its own virtual environment, outside the project's dependencies; create it with "
            "scripts/verifiers_venv.sh (python3.11 -m venv .venv-verifiers && "
            f".venv-verifiers/bin/pip install verifiers=={VERSION}), then install your environment's package "
            "into it (.venv-verifiers/bin/pip install <package>)"
        )


def check_verifiers_venv(cfg: Any) -> None:
    """The verifiers hub's start-up check (`inflight.rewards.hubs`), for a run of a verifiers
    environment: raise `VerifiersError` unless verifiers' python is there."""
    check_python(default_python())


def dataset_command(env_id: str, output: str | Path, env_args: dict[str, Any] | None = None,
                    python: str | None = None) -> list[str]:
    """The command that writes the environment's datasets as data files (`output`/train.jsonl and,
    when it has one, validation.jsonl): run it, then train with data.train_data / data.val_data."""
    cmd = [python or default_python(), "-P", str(WORKER), "dataset", env_id, "--output", str(output)]
    return cmd + (["--env-args", json.dumps(env_args)] if env_args else [])


def rollout_input(problem: Any) -> dict[str, Any]:
    """The environment's input for `problem`: its prompt, the row's answer as written, and the row's
    `verifiers` column (`example_id`, `task`, `info`), as the worker's `dataset` command writes them."""
    extras = problem.meta.get("extras") or {}
    own = extras.get("verifiers") or {}
    if not isinstance(own, dict):
        raise VerifiersError(
            f"problem {problem.id!r}: column 'verifiers' must be a mapping (example_id, task, "
            f"info), got {type(own).__name__}"
        )
    answer = extras.get("answer")
    row = {"prompt": problem.prompt, "answer": answer if isinstance(answer, str) else problem.answer,
           "example_id": own.get("example_id", 0), "info": own.get("info") or {}}
    if own.get("task"):
        row["task"] = own["task"]
    return row


class VerifiersAgent:
    """One worker process per run playing the episodes of the environment `env_id` (see the module
    docstring). `model`: the name the endpoint serves; `start_timeout_s`: most seconds the worker may
    take to load the environment."""

    def __init__(self, env_id: str, env_args: dict[str, Any] | None = None, *, model: str,
                 python: str | None = None, start_timeout_s: float = 300.0) -> None:
        self.env_id, self.env_args, self.model = env_id, dict(env_args or {}), model
        self.python, self.start_timeout_s = python or default_python(), start_timeout_s
        self.version: str | None = None
        self._proc: asyncio.subprocess.Process | None = None
        self._pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._ids = itertools.count()
        self._stderr: collections.deque[str] = collections.deque(maxlen=40)
        self._tasks: list[asyncio.Task[None]] = []
        self._died: str | None = None

    async def start(self) -> VerifiersAgent:
        """Start the worker and wait until it loaded the environment."""
        check_python(self.python)
        cmd = [self.python, "-P", str(WORKER), "serve", self.env_id, "--env-args", json.dumps(self.env_args)]
        self._proc = await asyncio.create_subprocess_exec(*cmd, stdin=asyncio.subprocess.PIPE, limit=2**26,
                                                          stdout=asyncio.subprocess.PIPE,
                                                          stderr=asyncio.subprocess.PIPE)
        self._tasks.append(asyncio.create_task(self._read_stderr(), name="verifiers-stderr"))
        try:
            async with asyncio.timeout(self.start_timeout_s):
                hello = await self._proc.stdout.readline()
        except TimeoutError:
            await self.close()
            raise VerifiersError(f"the verifiers worker did not load {self.env_id!r} within "
                                 f"{self.start_timeout_s:g} s{self._tail()}") from None
        ready = _message(hello)
        if not ready.get("ready"):
            await self.close()
            why = ready.get("error") or "it exited before saying it was ready"
            raise VerifiersError(
                f"the verifiers environment {self.env_id!r} could not be loaded "
                f"(load_environment({_args_text(self.env_args)})): {why}; is its package installed "
                f"in {self.python}'s venv (or its folder on PYTHONPATH)?{self._tail()}"
            )
        self.version = ready.get("verifiers")
        self._tasks.append(asyncio.create_task(self._read_replies(), name="verifiers-replies"))
        log.info(
            "verifiers %s: environment %r loaded (worker pid %d)", self.version, self.env_id, self._proc.pid
        )
        return self

    async def __call__(self, base_url: str, api_key: str, problem: Any) -> tuple[float, dict[str, Any]]:
        """One episode: the environment's rollout against the session, its rubric's reward."""
        if self._proc is None or self._proc.stdin is None:
            raise VerifiersError("the verifiers worker is not running: start() it first")
        if self._died is not None:
            raise AgentStopped(self._died)
        request_id = next(self._ids)
        request = {"id": request_id, "base_url": base_url, "api_key": api_key, "model": self.model,
                   "input": rollout_input(problem)}
        reply = self._pending[request_id] = asyncio.get_running_loop().create_future()
        try:
            self._proc.stdin.write((json.dumps(request) + "\n").encode())
            await self._proc.stdin.drain()
            answer = await reply
        except (BrokenPipeError, ConnectionResetError):
            raise AgentStopped(
                self._died or f"the verifiers worker of {self.env_id!r} stopped reading{self._tail()}"
            ) from None
        finally:
            self._pending.pop(request_id, None)
        if "error" in answer:
            raise VerifiersError(
                f"the verifiers environment {self.env_id!r} failed the episode: {answer['error']}"
            )
        return float(answer["reward"]), {"verifiers_metrics": answer.get("metrics") or {}}

    async def close(self, timeout_s: float = 10.0) -> None:
        """Stop the worker (idempotent): end its input, then terminate it if it lingers."""
        proc, self._proc = self._proc, None
        if proc is not None:
            if proc.stdin is not None and not proc.stdin.is_closing():
                proc.stdin.close()
            try:
                await asyncio.wait_for(proc.wait(), timeout_s)
            except TimeoutError:
                proc.kill()
                await proc.wait()
        # the readers end at the worker's end of output (its last lines kept), else are stopped
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=2.0)
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks.clear()
        self._fail_pending("the verifiers worker was stopped")

    # ---- the worker's output ------------------------------------------------------------------------
    async def _read_replies(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        proc = self._proc
        while line := await proc.stdout.readline():
            answer = _message(line)
            reply = self._pending.get(answer.get("id"))
            if reply is not None and not reply.done():
                reply.set_result(answer)
        code = await proc.wait()
        self._died = f"the verifiers worker of {self.env_id!r} exited (code {code}){self._tail()}"
        self._fail_pending(self._died)

    async def _read_stderr(self) -> None:
        assert self._proc is not None and self._proc.stderr is not None
        proc = self._proc
        while line := await proc.stderr.readline():
            text = line.decode(errors="replace").rstrip()
            self._stderr.append(text)
            log.debug("verifiers worker: %s", text)

    def _fail_pending(self, why: str) -> None:
        for reply in self._pending.values():
            if not reply.done():
                reply.set_exception(AgentStopped(why))

    def _tail(self) -> str:
        lines = [line for line in self._stderr if line.strip()][-15:]
        return ("; its last output:\n  " + "\n  ".join(lines)) if lines else ""


def _message(line: bytes) -> dict[str, Any]:
    try:
        value = json.loads(line)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _args_text(env_args: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in env_args.items())


__all__ = [
    "ENV_VAR",
    "VERSION",
    "WORKER",
    "VerifiersAgent",
    "VerifiersError",
    "check_python",
    "check_verifiers_venv",
    "dataset_command",
    "default_python",
    "rollout_input",
]
