"""`python -m inflight.server` in a subprocess: it serves, and when it is killed mid-request the
RemoteClient caller gets a clear error quickly instead of hanging."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time

import httpx
import pytest

from inflight.client import RemoteClient, ServerUnavailableError
from inflight.engine import SamplingParams
from inflight.server.main import build_parser, main


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float = 90.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"server exited early: {proc.stdout.read().decode()[-2000:]}"
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{url} did not become healthy in {timeout_s} s")


def test_parser_defaults_bind_loopback():
    args = build_parser().parse_args(["--model", "m"])
    assert (args.host, args.port, args.dtype, args.device) == ("127.0.0.1", 8000, "float32", "cpu")


def test_main_reports_a_bad_model_dir(tmp_path, capsys):
    assert main(["--model", str(tmp_path / "missing"), "--port", "0"]) == 2
    assert "error:" in capsys.readouterr().err


def test_subprocess_server_serves_then_dies_with_a_clear_error(model_dir):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "INFLIGHT_CONTROL_TOKEN": "tok"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "inflight.server", "--model", str(model_dir), "--port", str(port),
         "--block-size", "4", "--threads", "1", "--log-level", "warning", "--served-model-name", "tiny"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
    )

    async def scenario() -> float:
        async with RemoteClient(url, control_token="tok", retries=1, health_check_interval_s=1.0) as rc:
            out = await rc.generate([5, 6, 7], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
            assert len(out.output_token_ids) == 4 and out.finish_reason == "length"
            await rc.pause("keep")
            task = asyncio.create_task(rc.generate([5, 6, 7], SamplingParams(max_tokens=8)))
            await asyncio.sleep(0.3)
            assert not task.done()  # blocked by the pause
            proc.kill()
            start = time.monotonic()
            with pytest.raises(ServerUnavailableError) as err:
                await asyncio.wait_for(task, timeout=30)
            elapsed = time.monotonic() - start
            assert url in str(err.value) and "mid-request" in str(err.value)
            with pytest.raises(ServerUnavailableError, match="could not connect"):
                await rc.resume()
            return elapsed

    try:
        wait_healthy(url, proc)
        assert httpx.post(f"{url}/pause", timeout=10).status_code == 401  # the token from the environment
        elapsed = asyncio.run(scenario())
        assert elapsed < 5.0
    finally:
        proc.kill()
        proc.wait(timeout=30)
