"""Joining a weight group whose master nobody serves fails in seconds with a 502 naming the address,
not after the group's whole timeout (600 s by default), and leaving the group does not wait behind
it (issue 18 finding 9)."""

from __future__ import annotations

import socket
import time

import httpx

from inflight.client import wire


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # free now, and nobody listens on it


def test_an_unreachable_master_is_a_fast_502(server):
    headers = {"Authorization": f"Bearer {server.control_token}"}
    port = _closed_port()
    body = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2}
    with httpx.Client(base_url=server.url, timeout=60, headers=headers) as http:
        started = time.monotonic()
        r = http.post(wire.INIT_WEIGHT_TRANSFER, json=body)
        took = time.monotonic() - started
        assert r.status_code == 502, r.text
        error = r.json()["error"]
        assert error["code"] == "weight_transfer_unreachable" and f"127.0.0.1:{port}" in error["message"]
        assert took < 30  # the probe's few seconds, not timeout_s=600
        assert http.post(wire.DESTROY_WEIGHT_TRANSFER).status_code == 200
        assert http.get(wire.HEALTH).json()["status"] == "ok"
