"""Server processes this run starts and owns: start on free 127.0.0.1 ports, wait for /health, stop.

Backend-agnostic: a server is any command that serves our HTTP routes on the port it is given
(`inflight serve`, native or `--backend vllm`). Each runs in its own session (process group), its
output in `<log_dir>/server-<i>.log`, and is killed by the kernel if this process dies (Linux
`PR_SET_PDEATHSIG`, set by a small exec wrapper: the launching thread must outlive the servers, so
`ServerFleet.launch` runs in the caller's thread, never a worker thread). `close()` stops every
server it started (SIGTERM to the group, then SIGKILL), also after a failed or interrupted start.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from inflight.client.wire import HEALTH

CommandFor = Callable[[int], list[str]]
"""A server's command line for the port it is given."""

# exec `argv[2:]` with SIGKILL on parent death; exits at once if the parent (pid argv[1]) is already gone
_EXEC_WITH_PDEATHSIG = (
    "import ctypes, os, signal, sys\n"
    "try:\n"
    "    ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG\n"
    "except (AttributeError, OSError):\n"
    "    pass\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    sys.exit(1)\n"
    "os.execvp(sys.argv[2], sys.argv[2:])\n"
)


class ServerStartError(RuntimeError):
    """A server exited or did not answer /health in time; the message holds its log's tail."""


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on `host` now (the server binds it moments later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


@dataclass
class ServerProcess:
    """One started server: its URL, process and log file."""

    index: int
    url: str
    proc: subprocess.Popen[bytes]
    log_path: Path

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log_tail(self, lines: int = 40) -> str:
        """The last `lines` lines of the server's log."""
        try:
            with open(self.log_path, errors="replace") as f:
                return f"--- last lines of {self.log_path}:\n" + "".join(deque(f, maxlen=lines))
        except OSError:
            return f"(no log at {self.log_path})"

    def stop(self, timeout_s: float = 10.0) -> int:
        """SIGTERM to the server's process group, SIGKILL after `timeout_s`; returns its exit status."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                return self.proc.wait(timeout_s)
        return self.proc.wait()


class ServerFleet:
    """The servers of one run; `start` launches them all and waits until each answers /health."""

    def __init__(
        self, log_dir: str | Path, env: dict[str, str] | None = None, host: str = "127.0.0.1"
    ) -> None:
        self.log_dir, self.host = Path(log_dir), host
        self.env = {**os.environ, **(env or {})}
        self.servers: list[ServerProcess] = []  # running (until close)
        self.launched: list[ServerProcess] = []  # every server launched, stopped ones too

    @property
    def urls(self) -> list[str]:
        return [s.url for s in self.servers]

    def launch(self, command_for: CommandFor) -> ServerProcess:
        """Start one server (not waiting for it) on a free port; it is stopped by `close()`."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        index = len(self.launched)
        port = free_port(self.host)
        log_path = self.log_dir / f"server-{index}.log"
        argv = command_for(port)
        with open(log_path, "wb") as log:
            log.write(("$ " + " ".join(argv) + "\n").encode())
            log.flush()
            proc = subprocess.Popen(
                [sys.executable, "-c", _EXEC_WITH_PDEATHSIG, str(os.getpid()), *argv],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                start_new_session=True,  # its own group: one signal ends the server and its children
            )
        server = ServerProcess(index, f"http://{self.host}:{port}", proc, log_path)
        self.servers.append(server)
        self.launched.append(server)
        return server

    async def start(self, commands: Sequence[CommandFor], timeout_s: float) -> list[str]:
        """Launch one server per command and wait until every one answers /health with 200; on
        any failure (or cancellation) stop them all and raise. Returns their URLs."""
        try:
            for command_for in commands:
                self.launch(command_for)
            await asyncio.gather(*(wait_healthy(s, timeout_s) for s in self.servers))
        except BaseException:
            await self.close()
            raise
        return self.urls

    async def close(self) -> None:
        """Stop every server started (idempotent); the logs stay."""
        servers, self.servers = self.servers, []
        await asyncio.gather(*(asyncio.to_thread(s.stop) for s in servers))


async def wait_healthy(server: ServerProcess, timeout_s: float, poll_s: float = 0.2) -> None:
    """Until `server` answers GET /health with 200; `ServerStartError` if it exits or `timeout_s` passes."""
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(trust_env=False) as http:
        while True:
            if server.proc.poll() is not None:
                raise ServerStartError(f"server {server.index} ({server.url}) exited with status "
                                       f"{server.proc.returncode} during start-up\n{server.log_tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if (await http.get(server.url + HEALTH, timeout=5.0)).status_code == 200:
                    return
            if time.monotonic() > deadline:
                raise ServerStartError(f"server {server.index} ({server.url}) did not answer /health within "
                                       f"{timeout_s:.0f} s\n{server.log_tail()}")
            await asyncio.sleep(poll_s)
