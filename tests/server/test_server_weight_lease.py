"""A weight sender that dies between begin and finish no longer freezes generation (issue 18 finding 1):
the update is abandoned after `weight_update_timeout_s` without a chunk, the old weights come back,
the request that waited completes with the old model's tokens, and /health says "updating" while
the update is open."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from safetensors.torch import load_file

from inflight.client import wire
from inflight.engine import EngineConfig, LLMEngine, SamplingParams
from inflight.server.launch import serve_model

LEASE_S = 1.0
CONTROL_TOKEN = "lease-secret"


def engine_config(model_dir, **overrides) -> EngineConfig:
    return EngineConfig(model=str(model_dir), block_size=4, **overrides)


@pytest.fixture(scope="module")
def server(model_dir):
    srv = serve_model(
        engine_config(model_dir, weight_update_timeout_s=LEASE_S), "tiny", control_token=CONTROL_TOKEN
    )
    yield srv
    srv.stop()


def test_an_abandoned_update_expires_and_generation_goes_on(server, model_dir, reference):
    control = {"Authorization": f"Bearer {CONTROL_TOKEN}"}
    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 6, "temperature": 0, "return_token_ids": True}
    want = reference.generate([[5, 6, 7]], SamplingParams(max_tokens=6, temperature=0.0))[0].output_token_ids
    weights = load_file(str(model_dir / "model.safetensors"))
    name = sorted(weights)[0]
    with httpx.Client(base_url=server.url, timeout=30) as http, ThreadPoolExecutor(1) as pool:
        assert http.post(wire.WEIGHTS_BEGIN, headers=control).status_code == 200
        half = {name: weights[name] * 0 + 1.0}  # one chunk of the update, then the sender "dies"
        r = http.post(wire.WEIGHTS_CHUNK, headers={**control, "Content-Type": wire.CONTENT_TYPE},
                      content=wire.encode_tensors(half.items()))
        assert r.status_code == 200, r.text
        health = http.get(wire.HEALTH).json()
        assert health["status"] == "updating" and health["update"] == "open" and not health["can_run"]
        started = time.monotonic()
        waiting = pool.submit(http.post, "/v1/completions", json=body)
        out = waiting.result(timeout=LEASE_S + 10)  # without the lease: never
        assert out.status_code == 200, out.text
        assert out.json()["choices"][0]["token_ids"] == want  # the old weights, rolled back whole
        assert time.monotonic() - started < LEASE_S + 10
        health = http.get(wire.HEALTH).json()
        assert health["status"] == "ok" and health["update"] == "none" and health["weight_version"] == 0
    assert server.engine.engine.stats.expired_weight_updates == 1


def test_a_lease_counts_from_the_last_chunk(tiny_model_factory):
    engine = LLMEngine(engine_config(tiny_model_factory("qwen2"), weight_update_timeout_s=10.0))
    engine.begin_weight_update()
    opened = engine.status()
    assert opened.update == "open"
    touched = engine._update.touched
    assert engine.expire_weight_update(now=touched + 9.9) is False  # still within the lease
    assert engine.expire_weight_update(now=touched + 10.0) is True
    assert engine.status().update == "none" and engine.status().can_run
    assert engine.stats.expired_weight_updates == 1
    assert engine.expire_weight_update(now=touched + 100) is False  # nothing open any more
