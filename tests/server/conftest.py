"""Fixtures for the server tests: a tiny Qwen2 model served by uvicorn in a background thread on a
free 127.0.0.1 port (one server per test module), and the same engine in process as the reference."""

from __future__ import annotations

import httpx
import pytest
from openai import OpenAI
from transformers import AutoTokenizer

from inflight.engine import EngineConfig, LLMEngine
from inflight.server.launch import serve_model

CONTROL_TOKEN = "control-secret"
MODEL_NAME = "tiny"


def engine_config(model_dir, **overrides) -> EngineConfig:
    return EngineConfig(model=str(model_dir), block_size=4, **overrides)


@pytest.fixture(scope="session")
def model_dir(tiny_model_factory):
    return tiny_model_factory("qwen2")


@pytest.fixture(scope="session")
def tokenizer(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def reference(model_dir) -> LLMEngine:
    """The engine in process, configured like the served one: what the server must reproduce."""
    return LLMEngine(engine_config(model_dir))


@pytest.fixture(scope="module")
def server(model_dir):
    srv = serve_model(engine_config(model_dir), MODEL_NAME, control_token=CONTROL_TOKEN,
                      trust_request_chat_template=True)
    srv.model_name, srv.control_token = MODEL_NAME, CONTROL_TOKEN
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def http(server):
    """An httpx client on the module's server."""
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def client(server) -> OpenAI:
    """The official openai client on the module's server (no retries: a failure shows as it is)."""
    return OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
