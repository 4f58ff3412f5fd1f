"""Admitting a request never blocks the server's event loop for an engine step: while a
(deliberately slow) step runs, a new generation request is taken in, the server answers /health at
once, and bad input is still refused up front with a 400."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from inflight.client import wire
from inflight.engine import EngineConfig
from inflight.server.launch import serve_model

STEP_S = 2.0  # every model forward sleeps this long first
PROMPT = {"prompt_token_ids": [5, 6, 7], "sampling_params": {"max_tokens": 1, "temperature": 0.0}}


def slow_forward_server(model_dir):
    """A live server whose model forward sleeps STEP_S; `in_step` is set once a forward starts and
    `submitted` each time the server hands a generation to its engine."""
    server = serve_model(EngineConfig(model=str(model_dir), block_size=4), "tiny")
    model, engine = server.engine.engine.model, server.engine
    forward, generate = model.forward, engine.generate
    server.in_step, server.submitted = threading.Event(), threading.Event()

    def slow_forward(*args, **kwargs):
        server.in_step.set()
        time.sleep(STEP_S)
        return forward(*args, **kwargs)

    def noting_generate(*args, **kwargs):
        server.submitted.set()
        return generate(*args, **kwargs)

    model.forward, engine.generate = slow_forward, noting_generate
    return server


def timed(call) -> tuple[httpx.Response, float]:
    start = time.monotonic()
    response = call()
    return response, time.monotonic() - start


def test_admission_during_a_long_step_leaves_the_server_responsive(model_dir):
    server = slow_forward_server(model_dir)
    generate = lambda body: httpx.post(server.url + wire.GENERATE, json=body, timeout=60)  # noqa: E731
    try:
        with ThreadPoolExecutor(2) as pool:
            first = pool.submit(generate, PROMPT)
            assert server.in_step.wait(30)
            server.submitted.clear()
            second = pool.submit(generate, {**PROMPT, "prompt_token_ids": [8, 9]})
            assert server.submitted.wait(30)  # the second request is being admitted now
            time.sleep(0.1)
            health, health_s = timed(lambda: httpx.get(server.url + wire.HEALTH, timeout=30))
            bad, bad_s = timed(lambda: generate({**PROMPT, "prompt_token_ids": [10**9]}))
            assert health.status_code == 200 and health_s < STEP_S / 4, f"/health took {health_s:.2f}s"
            assert bad.status_code == 400 and bad_s < STEP_S / 4, f"bad input took {bad_s:.2f}s"
            assert "vocabulary" in bad.json()["error"]["message"]
            assert first.result(60).status_code == 200 and second.result(60).status_code == 200
    finally:
        server.stop()
