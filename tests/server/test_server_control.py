"""Control routes over HTTP: a chat completion that spans a KEEP pause and a weight update, the
reset_prefix_cache answer, sleep/wake, weight-update errors, /health, /weight_version and /metrics."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families
from safetensors.torch import load_file

from inflight.client import RemoteClient, RemoteEngineStateError, RemoteWeightUpdateError, update_weights
from inflight.client.wire import encode_tensors
from inflight.engine import SamplingParams

LONG = 600  # tokens: the request is still decoding when the pause lands


def metrics(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {
        s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples if not s.labels
    }


def wait_for(predicate, timeout_s: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


def remote(server) -> RemoteClient:
    return RemoteClient(server.url, control_token=server.control_token, retries=1)


def weights(model_dir):
    return list(load_file(str(model_dir / "model.safetensors")).items())


def run(coro):
    return asyncio.run(coro)


async def reset_via_client(server) -> bool:
    async with remote(server) as rc:
        return await rc.reset_prefix_cache()


def test_chat_in_flight_spans_keep_pause_and_weight_update(server, model_dir, reference, tokenizer):
    client = OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
    messages = [{"role": "user", "content": "tell me about the water"}]
    before = metrics(server.url)["inflight_generated_tokens_total"]
    version = server.engine.weight_version + 5

    async def pause_update_resume() -> tuple[float, float]:
        async with remote(server) as rc:
            await rc.pause("keep")
            frozen = metrics(server.url)["inflight_generated_tokens_total"]
            await asyncio.sleep(0.2)
            still = metrics(server.url)["inflight_generated_tokens_total"]
            assert await update_weights(rc, weights(model_dir), version) == version  # same weights
            await rc.resume()
            return frozen, still

    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(client.chat.completions.create, model="tiny", messages=messages, max_tokens=LONG,
                             temperature=0, extra_body={"ignore_eos": True, "return_token_ids": True})
        wait_for(
            lambda: metrics(server.url)["inflight_generated_tokens_total"] >= before + 3, what="decoding"
        )
        frozen, still = run(pause_update_resume())
        assert frozen == still and not future.done()  # nothing ran while paused; the call is blocked
        response = future.result(timeout=120)

    choice = response.choices[0]
    versions = choice.model_extra["token_weight_versions"]
    old = versions.count(version - 5)
    assert 0 < old < LONG and versions == [version - 5] * old + [version] * (LONG - old)
    assert choice.finish_reason == "length" and response.usage.completion_tokens == LONG
    # same weights under a new version: the tokens are what the engine generates without any pause
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    expected = reference.generate([ids], SamplingParams(max_tokens=LONG, temperature=0.0, ignore_eos=True))[0]
    assert choice.model_extra["token_ids"] == expected.output_token_ids
    assert httpx.get(f"{server.url}/weight_version").json() == {"weight_version": version}


def test_reset_prefix_cache_reports_failure_while_requests_hold_blocks(server):
    headers = {"Authorization": f"Bearer {server.control_token}"}
    body = {
        "prompt_token_ids": list(range(30, 50)),
        "sampling_params": {"max_tokens": LONG, "ignore_eos": True, "temperature": 0.0},
    }
    before = metrics(server.url)
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(httpx.post, f"{server.url}/inflight/v1/generate", json=body, timeout=120)
        wait_for(lambda: metrics(server.url)["inflight_generated_tokens_total"] >= before[
            "inflight_generated_tokens_total"] + 3, what="decoding")
        assert httpx.post(f"{server.url}/pause", params={"mode": "keep"}, headers=headers).json()["paused"]
        refused = httpx.post(f"{server.url}/reset_prefix_cache", headers=headers)
        assert refused.status_code == 409
        assert (
            refused.json()["success"] is False and refused.json()["error"]["code"] == "prefix_cache_not_reset"
        )
        assert run(reset_via_client(server)) is False
        done = httpx.post(f"{server.url}/reset_prefix_cache", params={"reset_running_requests": "true"},
                          headers=headers)
        assert done.status_code == 200 and done.json() == {"success": True}
        assert httpx.post(f"{server.url}/resume", headers=headers).status_code == 200
        out = future.result(timeout=120).json()
    assert len(out["output_token_ids"]) == LONG and out["finish_reason"] == "length"
    assert out["num_recomputed_tokens"] > 20  # it was reset and re-prefilled
    after = metrics(server.url)
    assert after["inflight_resets_total"] == before["inflight_resets_total"] + 1
    assert after["inflight_pauses_total"] == before["inflight_pauses_total"] + 1


def test_sleep_offload_wake_update_cycle(server, model_dir):
    async def cycle() -> tuple[int, dict]:
        async with remote(server) as rc:
            await rc.pause("keep")
            await rc.sleep(offload_kv=True)
            asleep = (await rc.health())[server.url]
            with pytest.raises(RemoteEngineStateError, match="asleep"):
                await rc.resume()
            await rc.wake_up(["weights"])
            version = await update_weights(rc, weights(model_dir))
            await rc.wake_up(["kv_cache"])
            await rc.resume()
            out = await rc.generate([5, 6, 7], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
            assert out.token_weight_versions == [version] * 4
            return version, asleep

    start = server.engine.weight_version
    version, asleep = run(cycle())
    assert version == start + 1
    assert (asleep["weights_awake"], asleep["kv_cache_awake"], asleep["paused"]) == (False, False, True)
    m = metrics(server.url)
    assert m["inflight_weight_version"] == version and m["inflight_paused"] == 0
    assert m["inflight_weights_awake"] == 1 and m["inflight_kv_cache_awake"] == 1


def test_bad_weight_updates_are_rejected_and_a_good_one_recovers(server, model_dir):
    headers = {"Authorization": f"Bearer {server.control_token}"}
    url = server.url
    good = weights(model_dir)
    name, tensor = good[0]
    failed_before = metrics(url)["inflight_failed_weight_updates_total"]
    assert httpx.post(f"{url}/weight_update/begin", headers=headers).status_code == 200
    wrong_shape = httpx.post(f"{url}/weight_update/chunk", headers=headers,
                             content=encode_tensors([(name, tensor.reshape(-1)[:-1].clone())]))
    assert wrong_shape.status_code == 400
    err = wrong_shape.json()["error"]
    assert err["code"] == "weight_update_error" and name in err["message"] and "shape" in err["message"]
    unknown = httpx.post(f"{url}/weight_update/chunk", headers=headers,
                         content=encode_tensors([("model.no_such.weight", tensor)]))
    assert unknown.status_code == 400 and "model.no_such.weight" in unknown.json()["error"]["message"]
    # the server keeps serving everything else, and says the truth: an update is open (issue 18)
    health = httpx.get(f"{url}/health")
    assert health.status_code == 200 and health.json()["status"] == "updating"
    assert httpx.get(f"{url}/v1/models").status_code == 200

    async def incomplete_then_complete() -> int:
        async with remote(server) as rc:
            with pytest.raises(RemoteWeightUpdateError, match="missing"):
                await update_weights(rc, good[:1])
            version = await update_weights(rc, good)
            out = await rc.generate([5, 6, 7], SamplingParams(max_tokens=3, temperature=0.0))
            assert out.token_weight_versions == [version] * len(out.output_token_ids)
            return version

    version = run(incomplete_then_complete())
    assert httpx.get(f"{url}/weight_version").json()["weight_version"] == version
    assert metrics(url)["inflight_failed_weight_updates_total"] >= failed_before + 2


def test_metrics_expose_engine_state(server):
    for _ in range(2):  # the second one hits the prefix cache
        httpx.post(f"{server.url}/inflight/v1/generate", timeout=60,
                   json={"prompt_token_ids": list(range(40, 60)), "sampling_params": {"max_tokens": 2}})
    m = metrics(server.url)
    for name in (
        "inflight_requests_running",
        "inflight_requests_waiting",
        "inflight_kv_cache_usage",
        "inflight_prefix_cache_hit_rate",
        "inflight_weight_version",
        "inflight_generated_tokens_total",
        "inflight_generation_tokens_per_second",
        "inflight_pauses_total",
        "inflight_resets_total",
        "inflight_kv_invalidated_resets_total",
        "inflight_preemptions_total",
    ):
        assert name in m, name
    stats = server.engine.stats
    assert m["inflight_generated_tokens_total"] == stats.generated_tokens
    assert m["inflight_finished_requests_total"] == stats.finished_requests
    assert m["inflight_requests_running"] == 0 and 0.0 <= m["inflight_kv_cache_usage"] <= 1.0
    assert (
        m["inflight_prefix_cache_hit_tokens_total"] >= 16 and 0.0 < m["inflight_prefix_cache_hit_rate"] < 1.0
    )
    assert m["inflight_prefix_cache_hit_rate"] == pytest.approx(
        stats.prefix_cache_hit_tokens / stats.prefix_cache_queried_tokens)
    text = httpx.get(f"{server.url}/metrics").text
    assert 'inflight_http_requests_total{route="/inflight/v1/generate",status="200"}' in text


def wait_no_requests(server, timeout_s: float = 10.0) -> None:
    wait_for(
        lambda: not server.engine.engine.has_unfinished_requests(), timeout_s, "the request to be aborted"
    )


def test_client_that_goes_away_has_its_request_aborted(server):
    headers = {"Authorization": f"Bearer {server.control_token}"}
    aborted = server.engine.stats.aborted_requests
    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": LONG, "ignore_eos": True}
    assert httpx.post(f"{server.url}/pause", params={"mode": "keep"}, headers=headers).status_code == 200
    try:
        with pytest.raises(httpx.ReadTimeout):  # non-streaming, blocked by the pause: the client gives up
            httpx.post(f"{server.url}/v1/completions", json=body, timeout=0.5)
        wait_no_requests(server)  # the server noticed the disconnect while waiting
    finally:
        assert httpx.post(f"{server.url}/resume", headers=headers).status_code == 200
    with httpx.stream("POST", f"{server.url}/v1/completions", json={**body, "stream": True}, timeout=30) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")  # streaming, then the client closes mid-stream
    wait_no_requests(server)
    assert server.engine.stats.aborted_requests == aborted + 2
    assert (
        httpx.post(f"{server.url}/v1/completions", json={**body, "max_tokens": 2}, timeout=30).status_code
        == 200
    )


def test_stream_sends_keepalives_while_paused_then_completes(server, monkeypatch):
    from inflight.server import openai_api

    monkeypatch.setattr(openai_api, "SSE_KEEPALIVE_S", 0.05)
    headers = {"Authorization": f"Bearer {server.control_token}"}
    client = OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 8, "ignore_eos": True, "stream": True}
    assert httpx.post(f"{server.url}/pause", params={"mode": "keep"}, headers=headers).status_code == 200
    try:
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=30) as r:
            lines = r.iter_lines()
            comments = [next(lines) for _ in range(6)]
            assert all(line in (": keep-alive", "") for line in comments) and ": keep-alive" in comments
            assert httpx.post(f"{server.url}/resume", headers=headers).status_code == 200
            data = [line for line in lines if line.startswith("data: ")]
        assert data[-1] == "data: [DONE]" and len(data) >= 3
        # the openai package skips the comments
        assert httpx.post(f"{server.url}/pause", params={"mode": "keep"}, headers=headers).status_code == 200
        with ThreadPoolExecutor(1) as pool:
            future = pool.submit(lambda: list(client.completions.create(
                model="tiny", prompt=[5, 6, 7], max_tokens=8, stream=True, extra_body={"ignore_eos": True})))
            time.sleep(0.3)
            assert httpx.post(f"{server.url}/resume", headers=headers).status_code == 200
            chunks = future.result(timeout=30)
        assert chunks[-1].choices[0].finish_reason == "length"
    finally:
        httpx.post(f"{server.url}/resume", headers=headers)


def test_pause_abort_finishes_in_flight_requests_with_partial_output(server):
    headers = {"Authorization": f"Bearer {server.control_token}"}
    before = metrics(server.url)["inflight_generated_tokens_total"]
    body = {"prompt_token_ids": [5, 6, 7], "sampling_params": {"max_tokens": LONG, "ignore_eos": True}}
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(httpx.post, f"{server.url}/inflight/v1/generate", json=body, timeout=60)
        wait_for(
            lambda: metrics(server.url)["inflight_generated_tokens_total"] >= before + 3, what="decoding"
        )
        paused = httpx.post(f"{server.url}/pause", params={"mode": "abort"}, headers=headers).json()
        out = future.result(timeout=60).json()
    assert paused["num_aborted"] == 1 and paused["paused"] is True
    assert out["finish_reason"] == "abort" and 3 <= len(out["output_token_ids"]) < LONG
    assert httpx.post(f"{server.url}/resume", headers=headers).json() == {"success": True, "paused": False}


def test_status_is_one_open_snapshot_of_the_lifecycle(server):
    """GET /status needs no token (read-only, like /health) and reports what the control routes did."""
    headers = {"Authorization": f"Bearer {server.control_token}"}
    url = server.url

    def status() -> dict:
        answer = httpx.get(f"{url}/status", timeout=10)
        assert answer.status_code == 200
        return answer.json()

    idle = status()
    assert set(idle) == {
        "weight_version", "pause", "pause_mode", "update", "can_roll_back", "weights_awake", "kv_cache_awake",
        "can_run", "num_running", "num_waiting", "num_frozen", "kv_cache_usage", "step_loop", "paused",
        "draining", "has_unfinished",
    }
    assert idle["weight_version"] == server.engine.weight_version
    assert (idle["pause"], idle["pause_mode"], idle["update"], idle["can_run"], idle["paused"]) == (
        "running", None, "none", True, False)
    assert idle["step_loop"] == {**idle["step_loop"], "stalled": False, "waiters": 0}
    assert httpx.post(f"{url}/pause", params={"mode": "keep"}, headers=headers).status_code == 200
    assert httpx.post(f"{url}/weight_update/begin", headers=headers).status_code == 200
    mid = status()
    assert (mid["pause"], mid["pause_mode"], mid["update"], mid["can_run"], mid["can_roll_back"]) == (
        "paused", "keep", "open", False, True)
    assert httpx.post(f"{url}/weight_update/abort", headers=headers).json()["restored"] is True
    assert httpx.post(f"{url}/resume", headers=headers).status_code == 200
    after = status()
    assert (after["pause"], after["update"], after["can_run"]) == ("running", "none", True)
    assert after["can_roll_back"] is False
    assert after["weight_version"] == idle["weight_version"]
