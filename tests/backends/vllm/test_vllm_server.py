"""The vLLM backend against transformers, through `RemoteClient` unchanged (issue 19).

One live vLLM CPU server for the module (`vllm_server` fixture). Model A is served first; updates
switch between A and B (same shapes, other seed). Requests are stopped mid-decode by a keep pause;
the tokens each side sampled are known exactly from their weight versions, and every token after
the update is held to the oracle of its KV fate:

- keep: B continues over A's KV (A computed every position but the last token sampled before the
  update, whose KV B computes in the first step after resume);
- recompute (explicit reset), and the SkyRL seed configuration (sleep without KV offload, no reset
  call: the shim's backstop resets): B re-reads the whole sequence so far.
"""

from __future__ import annotations

import asyncio
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
import torch

from inflight.client import RemoteClient, wire
from inflight.client.base import update_weights
from inflight.engine import EngineStateError, WeightUpdateError
from inflight.engine.request import SamplingParams
from inflight.testing.breaking_proxy import BreakingProxy

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "engine"))  # the engine tests' oracles
from conftest_weights import hf_continue  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(240)]

PROMPTS = [[5, 17, 33, 40, 41], [7, 8, 9, 10, 11, 12, 13, 14, 15], [100, 3, 250]]
# fp32 logits from another summation order (oneDNN vs torch) over 4 layers of 512/1024-wide sums:
# ~2n eps relative per sum, on logits of magnitude ~10 (scaled by 1/T): 2 * 1024 * 6e-8 * 10 / 0.7
TOL = 2e-3
LONG = 300  # decode length of the mid-decode tests: a pause lands mid-way (tried again if not), and the
# transformers oracle and vLLM CPU each take ~3x less time than at 1000 (CI: 3 tests of ~40 s)


@pytest.fixture(autouse=True)
def running_again(vllm_server):
    """After each test, the server runs again (a failed test must not leave it paused or updating)."""
    yield

    async def restore() -> None:
        client = await _client(vllm_server)
        await client.abort_weight_update()
        await client.wake_up()
        await client.resume()
        await client.close()

    run(restore())


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


def run(coro):
    return asyncio.run(coro)


async def _status_until(url: str, done: Callable[[dict], bool], timeout_s: float = 120.0,
                        interval_s: float = 0.002) -> dict:
    """The server's /status, polled until `done(status)` or `timeout_s` passed (then the last one): a
    deadline in seconds, not in polls, so a loaded host only makes the wait longer."""
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient() as http:
        while True:
            status = (await http.get(url + "/status")).json()
            if done(status) or time.monotonic() > deadline:
                return status
            await asyncio.sleep(interval_s)


async def _client(server, shm_chunks: bool = False) -> RemoteClient:
    return RemoteClient(
        server.url, control_token=server.token, health_check_interval_s=None, shm_chunks=shm_chunks
    )


async def _serve(client: RemoteClient, server, tag: str) -> int:
    """Make `tag`'s weights the served ones (a full update); returns the new version."""
    return await update_weights(client, list(server.weights[tag].items()))


async def _start_mid_decode(client: RemoteClient, server, prompts: list[list[int]] = PROMPTS,
                            attempts: int = 10, max_tokens: int = LONG) -> list[asyncio.Task]:
    """Start every prompt (`max_tokens` each) and keep-pause once each has sampled its first token
    (the server's /status shows each live request's progress); what the pause froze is checked and
    the start is tried again if the pause came too late (no assumption about decode speed)."""
    history = []
    async with httpx.AsyncClient() as http:
        for attempt in range(attempts):
            tasks = [
                asyncio.create_task(
                    client.generate(p, greedy(max_tokens, logprobs=False), request_id=f"mid-{attempt}-{i}")
                )
                for i, p in enumerate(prompts)
            ]
            await _status_until(
                server.url,
                lambda st, tasks=tasks: (
                    all(t.done() for t in tasks)
                    or (
                        len(st["live_output_tokens"]) == len(prompts)
                        and min(st["live_output_tokens"].values()) >= 1
                    )
                ),
            )
            await client.pause("keep")
            live = (await http.get(server.url + "/status")).json()["live_output_tokens"]
            failed = [repr(t.exception()) for t in tasks if t.done() and not t.cancelled() and t.exception()]
            history.append((sorted(live.values()), failed) if failed else sorted(live.values()))
            if len(live) == len(prompts) and min(live.values()) >= 1:
                return tasks
            await client.resume()
            await asyncio.gather(*tasks)
    raise AssertionError(f"no keep pause landed mid-decode in {attempts} attempts: {history}")


def _split(out, old: int, new: int) -> int:
    """How many tokens the old weights sampled; the versions must be old... then new..."""
    versions = out.token_weight_versions
    k = versions.count(old)
    assert versions == [old] * k + [new] * (len(versions) - k), versions
    assert 1 <= k < LONG, f"the pause did not land mid-decode (old weights sampled {k} of {LONG})"
    return k


def test_greedy_tokens_and_logprobs_equal_transformers(vllm_server):
    async def go():
        client = await _client(vllm_server)
        version = await client.weight_version()
        outs = await asyncio.gather(*(client.generate(p, greedy(24)) for p in PROMPTS))
        await client.close()
        return version, outs

    version, outs = run(go())
    model = vllm_server.hf["A"]
    for prompt, out in zip(PROMPTS, outs, strict=True):
        assert out.output_token_ids == hf_continue(model, model, prompt, 0, 24)
        assert out.token_weight_versions == [version] * 24 and out.finish_reason == "length"
        with torch.no_grad():
            logits = model(torch.tensor([prompt + out.output_token_ids])).logits[0, len(prompt) - 1 : -1]
        ref = torch.log_softmax(logits, -1).gather(1, torch.tensor(out.output_token_ids)[:, None])[:, 0]
        assert torch.allclose(torch.tensor(out.logprobs), ref, atol=TOL), (out.logprobs[:4], ref[:4])


def test_sampled_logprobs_are_temperature_scaled_before_filters(vllm_server):
    """logprobs of the sampled token under log_softmax(logits / T), and top_logprobs of that same
    distribution, most likely first."""
    params = SamplingParams(max_tokens=16, temperature=0.7, seed=3, top_logprobs=3, ignore_eos=True)

    async def go():
        client = await _client(vllm_server)
        out = await client.generate(PROMPTS[0], params)
        await client.close()
        return out

    out = run(go())
    model = vllm_server.hf["A"]
    with torch.no_grad():
        logits = model(torch.tensor([PROMPTS[0] + out.output_token_ids])).logits[0, len(PROMPTS[0]) - 1 : -1]
    scaled = torch.log_softmax(logits / 0.7, -1)
    for i, token in enumerate(out.output_token_ids):
        assert math.isclose(out.logprobs[i], scaled[i, token].item(), abs_tol=TOL)
        top = scaled[i].topk(3)
        assert [t for t, _ in out.top_logprobs[i]] == top.indices.tolist()
        assert torch.allclose(torch.tensor([lp for _, lp in out.top_logprobs[i]]), top.values, atol=TOL)


def test_logprobs_with_top_p_are_refused_not_different(vllm_server):
    async def go():
        client = await _client(vllm_server)
        try:
            await client.generate(PROMPTS[0], SamplingParams(max_tokens=4, top_p=0.9))
        finally:
            await client.close()

    with pytest.raises(Exception, match="top_p") as err:
        run(go())
    assert getattr(err.value, "status", None) == 400


def test_full_update_then_new_model_and_no_stale_prefix_cache(vllm_server):
    """After an update with nothing in flight: B's tokens; a prompt cached under A (two full
    128-token blocks) is not served from A's KV, and is cached again under B."""
    prompt = [(7 * i + 3) % 300 + 3 for i in range(300)]

    async def go():
        client = await _client(vllm_server)
        await _serve(client, vllm_server, "A")
        first = await client.generate(prompt, greedy(8))
        again = await client.generate(prompt, greedy(8))
        # as /dev/shm files
        version = await _serve(await _client(vllm_server, shm_chunks=True), vllm_server, "B")
        on_b = await client.generate(prompt, greedy(8))
        on_b_again = await client.generate(prompt, greedy(8))
        await client.close()
        return first, again, version, on_b, on_b_again

    first, again, version, on_b, on_b_again = run(go())
    hf_a, hf_b = vllm_server.hf["A"], vllm_server.hf["B"]
    assert first.output_token_ids == again.output_token_ids == hf_continue(hf_a, hf_a, prompt, 0, 8)
    assert again.num_cached_tokens == 256  # the prefix cache works within a version
    assert on_b.num_cached_tokens == 0 and on_b.token_weight_versions == [version] * 8
    assert on_b.output_token_ids == hf_continue(hf_b, hf_b, prompt, 0, 8)
    assert hf_continue(hf_b, hf_b, prompt, 0, 8) != first.output_token_ids
    with torch.no_grad():  # every weight took, not only enough of them to flip the tokens
        logits = hf_b(torch.tensor([prompt + on_b.output_token_ids])).logits[0, len(prompt) - 1 : -1]
    ref = torch.log_softmax(logits, -1).gather(1, torch.tensor(on_b.output_token_ids)[:, None])[:, 0]
    assert torch.allclose(torch.tensor(on_b.logprobs), ref, atol=TOL), (on_b.logprobs, ref)
    assert on_b_again.num_cached_tokens == 256 and on_b_again.output_token_ids == on_b.output_token_ids


def test_a_gloo_broadcast_update_serves_the_new_weights(vllm_server):
    """SkyRL's weight_sync_backend=gloo into vLLM: this client hosts the group (rank 0), the server
    joins it at rank 1 and takes each chunk's bytes in one broadcast, the largest tensors in pieces
    (a buffer of half the largest); the update serves B as transformers does, every weight of it."""
    weights = vllm_server.weights["B"]
    biggest = max(t.numel() * t.element_size() for t in weights.values())

    async def go():
        client = await _client(vllm_server)
        await _serve(client, vllm_server, "A")
        info = await client.init_weight_transfer("127.0.0.1", 0, backend="gloo", max_chunk_bytes=biggest // 2)
        joined = (await client.health())[vllm_server.url]["weight_transfer"]
        version = await client.update_weights_broadcast(list(weights.items()))
        outs = await asyncio.gather(*(client.generate(p, greedy(12)) for p in PROMPTS))
        await client.close_weight_transfer()
        left = (await client.health())[vllm_server.url]["weight_transfer"]
        await client.close()
        return info, joined, version, outs, left

    info, joined, version, outs, left = run(go())
    assert info["backend"] == "gloo" and joined["rank"] == 1 and joined["max_chunk_bytes"] == biggest // 2
    assert left is None
    hf_b = vllm_server.hf["B"]
    for prompt, out in zip(PROMPTS, outs, strict=True):
        assert out.token_weight_versions == [version] * 12
        assert out.output_token_ids == hf_continue(hf_b, hf_b, prompt, 0, 12)
        with torch.no_grad():
            logits = hf_b(torch.tensor([prompt + out.output_token_ids])).logits[0, len(prompt) - 1 : -1]
        ref = torch.log_softmax(logits, -1).gather(1, torch.tensor(out.output_token_ids)[:, None])[:, 0]
        assert torch.allclose(torch.tensor(out.logprobs), ref, atol=TOL), (out.logprobs[:4], ref[:4])


@pytest.mark.parametrize("fate", ["keep", "recompute", "skyrl"])
def test_frozen_requests_continue_as_transformers_predicts(vllm_server, fate):
    async def go():
        client = await _client(vllm_server)
        old = await _serve(client, vllm_server, "A")
        before = (await client.status())[vllm_server.url]["stats"]
        tasks = await _start_mid_decode(client, vllm_server)
        assert await client.reset_prefix_cache() is False  # frozen requests hold blocks: 409, said so
        if fate == "keep":
            new = await _serve(client, vllm_server, "B")
        elif fate == "recompute":
            new = await _serve(client, vllm_server, "B")
            assert await client.reset_prefix_cache(reset_running_requests=True) is True
        else:  # SkyRL's seed configuration: KV discarded by sleep, nobody asks for a reset
            await client.sleep(offload_kv=False)
            with pytest.raises(EngineStateError):
                await client.resume()  # asleep: refused, never generating on dropped weights
            await client.wake_up(["weights"])
            new = await _serve(client, vllm_server, "B")
            await client.wake_up(["kv_cache"])
        await client.resume()
        outs = await asyncio.gather(*tasks)
        after = (await client.status())[vllm_server.url]["stats"]
        await client.close()
        return old, new, outs, before, after

    old, new, outs, before, after = run(go())
    hf_a, hf_b = vllm_server.hf["A"], vllm_server.hf["B"]
    for prompt, out in zip(PROMPTS, outs, strict=True):
        k = _split(out, old, new)
        so_far = prompt + out.output_token_ids[:k]
        if fate == "keep":
            expected = hf_continue(hf_a, hf_b, so_far, len(so_far) - 1, LONG - k)
        else:
            expected = hf_continue(hf_b, hf_b, so_far, 0, LONG - k)
        assert out.output_token_ids[k:] == expected, f"{fate}: diverged after {k} tokens of A"
    invalidated = after["kv_invalidated_resets"] - before["kv_invalidated_resets"]
    assert invalidated == (len(PROMPTS) if fate == "skyrl" else 0)
    assert after["resets"] - before["resets"] == (len(PROMPTS) if fate == "recompute" else 0)


def test_refused_chunks_leave_the_old_weights_serving(vllm_server):
    weights = vllm_server.weights["A"]
    name = "model.layers.0.mlp.down_proj.weight"
    bad = {
        "nan": [(name, torch.full_like(weights[name], float("nan")))],
        "shape": [(name, weights[name][:, :-1])],
        "unknown": [("model.layers.9.mlp.down_proj.weight", weights[name])],
        "integer": [(name, weights[name].to(torch.int64))],
    }

    async def go():
        client = await _client(vllm_server)
        await _serve(client, vllm_server, "A")
        version = await client.weight_version()
        errors = {}
        await client.begin_weight_update()
        for what, chunk in bad.items():
            with pytest.raises(WeightUpdateError) as err:
                await client.load_weights(chunk)
            errors[what] = str(err.value)
        with pytest.raises(WeightUpdateError, match="incomplete"):
            await client.finish_weight_update()  # nothing valid was sent
        with pytest.raises(EngineStateError):
            await client.resume()  # the update failed: refused until aborted or completed
        assert await client.abort_weight_update() is True
        out = await client.generate(PROMPTS[1], greedy(12))
        after = await client.weight_version()
        await client.close()
        return version, errors, out, after

    version, errors, out, after = run(go())
    for what, message in errors.items():
        assert ("model.layers.9" if what == "unknown" else name) in message, (what, message)
    assert after == version and out.token_weight_versions == [version] * 12
    hf_a = vllm_server.hf["A"]
    assert out.output_token_ids == hf_continue(hf_a, hf_a, PROMPTS[1], 0, 12)


def test_openai_completions_are_version_salted(vllm_server):
    """vLLM's own /v1/completions, behind the shim's salt: after an update a cached prompt is read
    again by the new weights."""
    prompt = [(11 * i + 5) % 300 + 3 for i in range(260)]

    async def completion(http: httpx.AsyncClient) -> dict:
        body = {"model": str(vllm_server.models["A"].resolve()), "prompt": prompt, "max_tokens": 6,
                "temperature": 0, "return_token_ids": True}
        response = await http.post(vllm_server.url + "/v1/completions", json=body)
        assert response.status_code == 200, response.text
        return response.json()

    async def go():
        client = await _client(vllm_server)
        async with httpx.AsyncClient(timeout=120) as http:
            await _serve(client, vllm_server, "A")
            a1, a2 = await completion(http), await completion(http)
            await _serve(client, vllm_server, "B")
            b = await completion(http)
        await client.close()
        return a1, a2, b

    a1, a2, b = run(go())
    hf_a, hf_b = vllm_server.hf["A"], vllm_server.hf["B"]
    assert (
        a1["choices"][0]["token_ids"]
        == a2["choices"][0]["token_ids"]
        == hf_continue(hf_a, hf_a, prompt, 0, 6)
    )
    assert b["choices"][0]["token_ids"] == hf_continue(hf_b, hf_b, prompt, 0, 6)


def test_control_routes_need_the_token(vllm_server):
    response = httpx.post(vllm_server.url + "/pause", params={"mode": "keep"})
    assert response.status_code == 401 and response.json()["error"]["code"] == "missing_control_token"
    response = httpx.post(vllm_server.url + "/pause", headers={"Authorization": "Bearer wrong"})
    assert response.status_code == 403
    health = httpx.get(vllm_server.url + "/health").json()
    assert health["status"] == "ok" and health["backend"] == "vllm"


def test_a_client_that_goes_away_aborts_its_request_in_vllm(vllm_server):
    """A caller that closes its connection aborts its request inside vLLM, also a frozen one."""
    async def go():
        client = await _client(vllm_server)
        tasks = await _start_mid_decode(client, vllm_server, [PROMPTS[0]])
        frozen = (await client.status())[vllm_server.url]
        tasks[0].cancel()  # RemoteClient closes the connection
        await asyncio.gather(*tasks, return_exceptions=True)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            now = (await client.status())[vllm_server.url]
            if not now["live_output_tokens"] and now["vllm_num_unfinished"] == 0:
                break
            await asyncio.sleep(0.05)
        await client.resume()
        await client.close()
        return frozen, now

    frozen, now = run(go())
    assert frozen["vllm_num_unfinished"] == 1 and len(frozen["live_output_tokens"]) == 1
    assert now["live_output_tokens"] == {} and now["vllm_num_unfinished"] == 0 and now["paused"]


def test_every_parameter_of_an_update_takes(vllm_server):
    """Norm weights and biases too (A and B share theirs, ones and zeros, so a stale one would not
    show in B's tokens): an update to B with every 1-D parameter moved serves transformers on it."""
    import copy

    moved = {
        n: (
            t + 0.05 * torch.randn(t.shape, generator=torch.Generator().manual_seed(i)) if t.dim() == 1 else t
        )
        for i, (n, t) in enumerate(sorted(vllm_server.weights["B"].items()))
    }
    hf = copy.deepcopy(vllm_server.hf["B"])
    missing, unexpected = hf.load_state_dict(moved, strict=False)
    assert not unexpected

    async def go():
        client = await _client(vllm_server)
        await update_weights(client, list(moved.items()))
        outs = await asyncio.gather(*(client.generate(p, greedy(12)) for p in PROMPTS))
        await client.close()
        return outs

    for prompt, out in zip(PROMPTS, run(go()), strict=True):
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + out.output_token_ids])).logits[0, len(prompt) - 1 : -1]
        ref = torch.log_softmax(logits, -1).gather(1, torch.tensor(out.output_token_ids)[:, None])[:, 0]
        assert out.output_token_ids == hf_continue(hf, hf, prompt, 0, 12)
        assert torch.allclose(torch.tensor(out.logprobs), ref, atol=TOL), (out.logprobs[:4], ref[:4])


def test_a_generation_whose_connection_broke_is_sent_again_and_the_orphan_aborted(vllm_server):
    """The failure one training run on vLLM died of (ReadError mid-generate): the connection breaks
    after the request went out. The client sends it once more; vLLM aborts the orphan."""

    async def go():
        direct = await _client(vllm_server)
        expected = await direct.generate(PROMPTS[0], greedy(64))
        proxy = BreakingProxy(int(vllm_server.url.rsplit(":", 1)[1]), wire.GENERATE)
        url = await proxy.start()
        async with proxy.server, RemoteClient(url, health_check_interval_s=None) as rc:
            output = await rc.generate(PROMPTS[0], greedy(64))
        assert (proxy.broken, proxy.generations) == (1, 2)
        assert output.output_token_ids == expected.output_token_ids
        # the orphan leaves vLLM (aborted or finished): nothing stays live
        status = await _status_until(
            vllm_server.url, lambda st: not st["live_output_tokens"], interval_s=0.02
        )
        assert not status["live_output_tokens"], "the broken request is still running in vLLM"
        await direct.close()

    run(go())


PAUSE_CAP_S = 120  # a cap, not a measurement: a pause that must return without its request finishing
PROVED = ("draining", "running, request live", "frozen", "pause returned, request unfinished",
          "pause(wait) answered running", "completed")


async def _resume_mid_drain(client: RemoteClient, server) -> dict:
    """One try: a request frozen mid-decode drains under pause(wait); once the server says it is
    draining with the request live, a resume; then a keep pause freezes the request, so it cannot
    finish, and the pause(wait) must still return, its answer saying the server was running (a
    drain ended by the keep pause would answer paused). What the server said at each step."""
    (long,) = await _start_mid_decode(client, server, [PROMPTS[0]])  # frozen mid-decode (keep)
    async with httpx.AsyncClient(timeout=PAUSE_CAP_S) as http:  # the pause's own answer
        pause = asyncio.create_task(http.post(server.url + wire.PAUSE, params={"mode": "wait"},
                                              headers={"Authorization": f"Bearer {server.token}"}))
        seen = await _status_until(server.url, lambda st: st["pause"] == "draining" or pause.done())
        step = {"draining": seen["pause"] == "draining" and bool(seen["live_output_tokens"])}
        if step["draining"]:
            await client.resume()  # ends the drain: the request decodes on
            after = (await client.status())[server.url]
            step["running, request live"] = after["pause"] == "running" and bool(after["live_output_tokens"])
            await client.pause("keep")  # from here the request cannot finish (unless it already did)
            step["frozen"] = bool((await client.status())[server.url]["live_output_tokens"])
        try:
            answer = await asyncio.wait_for(pause, timeout=PAUSE_CAP_S)
        except (TimeoutError, httpx.TimeoutException):
            raise AssertionError(
                f"pause(wait) had not returned {PAUSE_CAP_S} s after the resume (a cap: it waited "
                f"for its frozen request, i.e. the resume did not end the drain); {step}"
            ) from None
    step["pause returned, request unfinished"] = bool(
        (await client.status())[server.url]["live_output_tokens"]
    )
    step["pause(wait) answered running"] = answer.status_code == 200 and answer.json()["paused"] is False
    await client.resume()
    out = await long
    step["completed"] = len(out.output_token_ids) == LONG and out.finish_reason == "length"
    return step


def test_a_wait_pause_drains_and_a_resume_ends_the_drain(vllm_server):
    """pause(wait) returns once the in-flight requests finished, paused; a resume during the drain
    ends it at once (the request keeps decoding and completes), as on the native engine. Each step
    is read off the server's state, never timed: the drain is seen with its request live, the
    resume leaves the request running, and the pause(wait) returns while that request is frozen
    and so cannot have finished, answering that the server runs (tried again when the request
    finished between two steps)."""

    async def go():
        client = await _client(vllm_server)
        short = asyncio.create_task(client.generate(PROMPTS[1], greedy(16), request_id="short"))
        # in flight before the pause (no guess at its speed)
        await _status_until(vllm_server.url, lambda st: "short" in st["live_output_tokens"] or short.done())
        await client.pause("wait")
        drained = (await client.status())[vllm_server.url]["pause"]
        # paused, nothing decodes: the request completes only if it had finished before the pause returned
        try:
            out = await asyncio.wait_for(short, timeout=PAUSE_CAP_S)
        except TimeoutError:
            raise AssertionError("pause(wait) returned before the request in flight finished (it never "
                                 f"completed while paused; {PAUSE_CAP_S} s cap)") from None
        still = (await client.status())[vllm_server.url]
        await client.resume()
        attempts = []
        for _ in range(5):
            attempts.append(await _resume_mid_drain(client, vllm_server))
            if all(attempts[-1].get(k) for k in PROVED):
                break
        await client.close()
        return drained, still, out, attempts

    drained, still, out, attempts = run(go())
    assert drained == still["pause"] == "paused" and not still["live_output_tokens"], still
    assert len(out.output_token_ids) == 16
    assert all(step["completed"] for step in attempts), attempts
    assert all(attempts[-1].get(k) for k in PROVED), f"the resume did not end the drain: {attempts}"
