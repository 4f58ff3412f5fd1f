"""Fixtures for the client tests: tiny Qwen2 servers in background threads on free 127.0.0.1 ports."""

from __future__ import annotations

import pytest

from inflight.engine import EngineConfig
from inflight.server.launch import serve_model

CONTROL_TOKEN = "control-secret"


@pytest.fixture(scope="session")
def model_dir(tiny_model_factory):
    return tiny_model_factory("qwen2")


@pytest.fixture(scope="module")
def serve(model_dir):
    """serve(**engine_overrides) -> a started server (`.url`, `.engine`); all stopped at module end."""
    servers = []

    def start(**overrides):
        config = EngineConfig(model=str(model_dir), block_size=4, **overrides)
        srv = serve_model(config, "tiny", control_token=CONTROL_TOKEN)
        srv.control_token = CONTROL_TOKEN
        servers.append(srv)
        return srv

    yield start
    for srv in servers:
        srv.stop()
