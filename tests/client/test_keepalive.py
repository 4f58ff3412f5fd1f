"""RemoteClient drops idle pooled connections before a server's own idle timeout can close one as a
request goes out on it (a generation request lost that way is never re-sent: the run ends)."""

from __future__ import annotations

import re
from pathlib import Path

import uvicorn

import inflight
from inflight.client import RemoteClient
from inflight.client.remote import KEEPALIVE_EXPIRY_S


def test_the_client_lets_idle_connections_go_before_the_servers_do():
    client = RemoteClient("http://127.0.0.1:1")
    assert client._limits.keepalive_expiry == KEEPALIVE_EXPIRY_S
    server_idle_s = [uvicorn.Config(app=None).timeout_keep_alive]  # the native server: uvicorn's default
    # run by vLLM's python: read, not imported
    shim = Path(inflight.__file__).parent / "backends" / "vllm" / "server.py"
    server_idle_s += [int(v) for v in re.findall(r"timeout_keep_alive=(\d+)", shim.read_text())]
    assert len(server_idle_s) == 2 and KEEPALIVE_EXPIRY_S < min(server_idle_s)
