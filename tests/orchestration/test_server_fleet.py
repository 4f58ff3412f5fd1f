"""The server launcher (`inflight.orchestration.server_fleet`) with the native `inflight serve`: N servers on
free ports behind their control token, and no process left behind after close, a failed start, a
cancelled start (Ctrl-C), or the death of the process that launched them."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from functools import partial

import httpx
import pytest

from inflight.backends.serve_command import native_command
from inflight.client.remote import RemoteClient
from inflight.engine.config import EngineConfig
from inflight.orchestration.server_fleet import ServerFleet, ServerStartError
from inflight.orchestration.servers import CONTROL_TOKEN_ENV, check_external

pytestmark = pytest.mark.timeout(180)
SLEEPER = [sys.executable, "-c", "import time; time.sleep(600)"]  # never answers /health


def _gone(pid: int, within_s: float = 15.0) -> bool:
    """Whether process `pid` is gone (exited, and reaped if it was our child) within the bound."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            if os.waitpid(pid, os.WNOHANG)[0] == pid:
                return True
        except ChildProcessError:  # not our child (or already reaped): does it still exist?
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)


def _kill_if_alive(servers) -> None:
    """Kill (by pid) the servers a failed test left running; never a pid already reaped."""
    for server in servers:
        if server.proc.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
            server.proc.wait(10)


def test_two_native_servers_behind_a_token_and_nothing_left_after_close(tiny_model_factory, tmp_path):
    model = tiny_model_factory()
    engines = [
        EngineConfig(model=str(model), num_kv_blocks=16, max_model_len=64, weight_version=v) for v in (0, 5)
    ]
    fleet = ServerFleet(tmp_path / "servers", env={CONTROL_TOKEN_ENV: "s3cret"})

    async def run():
        try:
            urls = await fleet.start([partial(native_command, e) for e in engines], timeout_s=120)
            async with httpx.AsyncClient(trust_env=False) as http:
                refused = (await http.post(urls[0] + "/pause", params={"mode": "keep"})).status_code
            client = RemoteClient(urls, control_token="s3cret")
            versions = await client.weight_versions()
            with pytest.raises(ValueError, match=r"at different weight versions .*--weight-version N"):
                await check_external(client)  # what a run checks of servers started elsewhere
            await client.pause("keep")
            await client.resume()
            await client.close()
            return urls, refused, versions
        finally:
            await fleet.close()

    try:
        urls, refused, versions = asyncio.run(run())
    finally:
        _kill_if_alive(fleet.launched)  # only if close() failed to
    pids = [s.pid for s in fleet.launched]
    assert len(set(urls)) == 2 and all(u.startswith("http://127.0.0.1:") for u in urls)
    assert refused == 401 and versions == dict(zip(urls, (0, 5), strict=True))
    assert all(_gone(pid) for pid in pids) and fleet.servers == []
    assert sorted(p.name for p in (tmp_path / "servers").iterdir()) == ["server-0.log", "server-1.log"]
    assert (
        "-m inflight.cli serve --model" in (tmp_path / "servers" / "server-0.log").read_text().splitlines()[0]
    )


def test_a_failed_start_stops_the_servers_already_started(tmp_path):
    fleet = ServerFleet(tmp_path)
    bad = [sys.executable, "-m", "inflight.cli", "serve", "--model", str(tmp_path / "no-such-model")]
    try:
        with pytest.raises(
            ServerStartError, match=r"server 1 .* exited with status 2 during start-up"
        ) as err:
            asyncio.run(fleet.start([lambda p: SLEEPER, lambda p: [*bad, "--port", str(p)]], timeout_s=120))
        assert "server-1.log" in str(err.value) and "error:" in str(err.value)  # the log's tail
        assert len(fleet.launched) == 2 and all(_gone(s.pid) for s in fleet.launched) and fleet.servers == []
    finally:
        _kill_if_alive(fleet.launched)


def test_a_server_that_never_answers_is_stopped_at_the_timeout(tmp_path):
    fleet = ServerFleet(tmp_path)
    try:
        with pytest.raises(ServerStartError, match=r"did not answer /health within 1 s"):
            asyncio.run(fleet.start([lambda p: SLEEPER], timeout_s=1))
        assert _gone(fleet.launched[0].pid)
    finally:
        _kill_if_alive(fleet.launched)


def test_an_interrupted_start_stops_the_servers(tmp_path):
    """Ctrl-C during start-up reaches the start as a cancellation: the servers are stopped."""
    fleet = ServerFleet(tmp_path)

    async def run():
        task = asyncio.ensure_future(fleet.start([lambda p: SLEEPER] * 2, timeout_s=60))
        while len(fleet.launched) < 2:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    try:
        asyncio.run(run())
        assert all(_gone(s.pid) for s in fleet.launched) and fleet.servers == []
    finally:
        _kill_if_alive(fleet.launched)


def test_the_servers_die_with_the_process_that_launched_them(tmp_path):
    """A launcher killed with SIGKILL (no clean-up runs) takes its servers with it (PR_SET_PDEATHSIG)."""
    script = textwrap.dedent(f"""
        import sys, time
        from inflight.orchestration.server_fleet import ServerFleet
        fleet = ServerFleet({str(tmp_path)!r})
        server = fleet.launch(lambda port: {SLEEPER!r})
        print(server.pid, flush=True)
        time.sleep(600)
    """)
    launcher = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    server_pid = int(launcher.stdout.readline())
    try:
        time.sleep(0.5)  # the wrapper has set PR_SET_PDEATHSIG and exec'd the server by now
        assert not _gone(server_pid, within_s=0.2)
        launcher.kill()
        launcher.wait(10)
        assert _gone(server_pid)
    finally:
        launcher.kill()
        launcher.wait(10)
        if not _gone(server_pid, within_s=0):
            os.kill(server_pid, signal.SIGKILL)
