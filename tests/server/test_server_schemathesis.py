"""Property-based fuzzing of every route from the server's own OpenAPI schema (schemathesis): no
internal error and no hang, whatever the body, query or token (issue 18). A 5xx is allowed only as
the documented answer of a route whose upstream the request named (502/504 from the weight-group
routes: nobody listens at the given master address), always with an OpenAI-style error body. Control
routes get the token; after each case the engine is put back to serving (abort an update, wake,
resume), so a paused engine does not hold the next case. Bounded: a few examples per operation, about
300 in all."""

from __future__ import annotations

import httpx
import pytest
from hypothesis import HealthCheck, given, settings

from inflight.client import wire
from inflight.engine import EngineConfig
from inflight.server.launch import serve_model

schemathesis = pytest.importorskip("schemathesis")

CONTROL = "fuzz-control"
EXAMPLES_PER_OPERATION = 12


def _app_schema(model_dir) -> dict:
    from transformers import AutoTokenizer

    from inflight.engine import AsyncEngine, LLMEngine
    from inflight.server.app import create_app

    engine = AsyncEngine(LLMEngine(EngineConfig(model=str(model_dir), block_size=4, num_kv_blocks=32)))
    return create_app(engine, AutoTokenizer.from_pretrained(model_dir), "tiny").openapi()


@pytest.fixture(scope="module")
def server(model_dir):
    config = EngineConfig(model=str(model_dir), block_size=4, num_kv_blocks=32, max_model_len=128,
                          weight_update_timeout_s=5.0)
    srv = serve_model(config, "tiny", control_token=CONTROL)
    yield srv
    srv.stop()


def _restore(url: str, weights: list) -> None:
    """Put the engine back to serving: abandon an update, wake both pools, resume; after a sleep
    (which drops the weights, by design) send them again whole."""
    headers = {"Authorization": f"Bearer {CONTROL}"}
    with httpx.Client(base_url=url, timeout=30, headers=headers) as http:
        http.post(wire.WEIGHTS_ABORT)
        http.post(wire.WAKE_UP)
        if http.get(wire.STATUS).json()["update"] != "none":  # slept: the weights are gone
            assert http.post(wire.WEIGHTS_BEGIN).status_code == 200
            sent = http.post(wire.WEIGHTS_CHUNK, content=wire.encode_tensors(weights),
                             headers={**headers, "Content-Type": wire.CONTENT_TYPE})
            assert sent.status_code == 200, sent.text
            assert http.post(wire.WEIGHTS_FINISH).status_code == 200
        http.post(wire.RESUME)
        assert http.get(wire.STATUS).json()["can_run"]


@pytest.fixture(scope="module")
def schema(model_dir):
    return schemathesis.openapi.from_dict(_app_schema(model_dir))


def test_no_route_answers_5xx_or_hangs(schema, server, model_dir, monkeypatch):
    from safetensors.torch import load_file

    from inflight.weight_sync import group

    weights = sorted(load_file(str(model_dir / "model.safetensors")).items())
    monkeypatch.setattr(group, "PROBE_S", 0.2)  # random master addresses: refuse them quickly
    operations = [op.ok() for op in schema.get_all_operations()]
    assert len(operations) >= 10, [op.label for op in operations]
    seen = 0
    for operation in operations:
        @settings(max_examples=EXAMPLES_PER_OPERATION, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(case=operation.as_strategy())
        def fuzz(case):
            nonlocal seen
            headers = {"Authorization": f"Bearer {CONTROL}"}
            response = case.call(base_url=server.url, headers=headers, timeout=30)
            seen += 1
            status, what = (
                response.status_code,
                (case.method, case.path, response.status_code, response.text[:500]),
            )
            if status >= 500:
                error = response.json()["error"]
                assert status in (502, 504) and error["code"].startswith("weight_transfer"), what
            _restore(server.url, weights)

        fuzz()
    assert seen >= 100
    with httpx.Client(base_url=server.url, timeout=30) as http:  # and it still serves
        r = http.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0})
        assert r.status_code == 200
