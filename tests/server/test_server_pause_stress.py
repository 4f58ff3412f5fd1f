"""A bounded stress test of in-flight pauses over HTTP: 120 concurrent completions while another
coroutine pauses (keep / abort / wait) and resumes the server, with weight updates in between,
streaming and not. Every request must answer exactly once, soon after the last resume, with the
tokens the engine produces without any pause (or, when aborted, a prefix of them)."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from safetensors.torch import load_file

from inflight.client import RemoteClient, update_weights
from inflight.engine import SamplingParams

NUM_REQUESTS = 120
CYCLES = 4
ANSWER_AFTER_RESUME_S = 5.0  # no request may still be waiting this long after the last resume
CALL_TIMEOUT_S = 30.0
RUNS = 3  # per case: 8 cases x 3 runs x ~1 s


def max_tokens(i: int) -> int:
    return 8 + i % 40


def body(i: int, stream: bool) -> dict:
    return {"model": "tiny", "prompt": f"{i}+{i}=", "max_tokens": max_tokens(i), "temperature": 0,
            "ignore_eos": True, "return_token_ids": True, "stream": stream}


@pytest.fixture(scope="module")
def expected(reference, tokenizer) -> list[list[int]]:
    prompts = [tokenizer(f"{i}+{i}=")["input_ids"] for i in range(NUM_REQUESTS)]
    params = [
        SamplingParams(max_tokens=max_tokens(i), temperature=0.0, ignore_eos=True)
        for i in range(NUM_REQUESTS)
    ]
    return [o.output_token_ids for o in reference.generate(prompts, params)]


async def complete(client: httpx.AsyncClient, i: int, stream: bool) -> tuple[list[int], list[str], float]:
    """(token ids, finish reasons seen, time answered) of one completion."""
    if not stream:
        r = await client.post("/v1/completions", json=body(i, False))
        assert r.status_code == 200, r.text
        choices = r.json()["choices"]
        assert len(choices) == 1
        return choices[0]["token_ids"], [choices[0]["finish_reason"]], time.monotonic()
    ids, reasons, done = [], [], 0
    async with client.stream("POST", "/v1/completions", json=body(i, True)) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line == "data: [DONE]":
                done += 1
            elif line.startswith("data: "):
                choice = json.loads(line[6:])["choices"][0]
                ids += choice["token_ids"]
                if choice["finish_reason"] is not None:
                    reasons.append(choice["finish_reason"])
    assert done == 1
    return ids, reasons, time.monotonic()


async def cycle(server, model_dir, mode: str, update: bool) -> float:
    """CYCLES x (sleep, pause, sleep, [weight update with the same weights], resume); returns the time
    of the last resume."""
    weights = list(load_file(str(model_dir / "model.safetensors")).items()) if update else None
    async with RemoteClient(server.url, control_token=server.control_token, retries=1) as rc:
        for _ in range(CYCLES):
            await asyncio.sleep(0.05)
            await rc.pause(mode)
            await asyncio.sleep(0.05)
            if weights is not None:
                await update_weights(rc, weights, server.engine.weight_version + 1)
            await rc.resume()
    return time.monotonic()


async def scenario(server, model_dir, mode: str, stream: bool, update: bool):
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=NUM_REQUESTS)
    async with httpx.AsyncClient(base_url=server.url, timeout=CALL_TIMEOUT_S, limits=limits) as client:
        calls = [asyncio.ensure_future(complete(client, i, stream)) for i in range(NUM_REQUESTS)]
        last_resume = await cycle(server, model_dir, mode, update)
        results = await asyncio.gather(*calls)
    return results, last_resume


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize(
    ("mode", "update"), [("keep", False), ("keep", True), ("abort", False), ("wait", True)]
)
def test_every_request_answers_once_across_pause_cycles(server, model_dir, expected, mode, stream, update):
    for _ in range(RUNS):
        results, last_resume = asyncio.run(scenario(server, model_dir, mode, stream, update))
        for i, (ids, reasons, answered) in enumerate(results):
            assert len(reasons) == 1, (i, reasons)  # finished exactly once
            assert answered - last_resume < ANSWER_AFTER_RESUME_S, i
            if reasons == ["abort"]:
                assert mode == "abort" and ids == expected[i][: len(ids)], i
            else:
                assert reasons == ["length"] and ids == expected[i], (i, reasons)
        assert not server.engine.engine.requests and server.engine.health()["waiters"] == 0
        assert server.engine.missed_wakeups == 0
    health = httpx.get(f"{server.url}/health", timeout=10)
    assert health.status_code == 200 and health.json()["step_loop"]["stalled"] is False
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    assert "inflight_step_loop_stalled 0.0" in text and "inflight_missed_wakeups_total 0.0" in text
