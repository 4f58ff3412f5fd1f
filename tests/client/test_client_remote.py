"""RemoteClient and LocalClient: the same protocol with the same results and errors; fan-out that
fails loudly; fail-over only for requests never sent; retries with backoff for idempotent calls only;
dead or hung servers surface as ServerUnavailableError, not a hang."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import socket
import time

import httpx
import pytest
import torch
from safetensors.torch import load_file
from tolerance import assert_close_to_reference, other_thread_count

from inflight.client import (
    FanOutError,
    InferenceClient,
    LocalClient,
    RemoteClient,
    ServerUnavailableError,
    update_weights,
)
from inflight.engine import (
    AsyncEngine,
    EngineConfig,
    EngineStateError,
    InvalidRequestError,
    LLMEngine,
    SamplingParams,
    WeightUpdateError,
)

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


async def lifecycle(client: InferenceClient, weights) -> dict:
    """The same calls a trainer makes, against any client."""
    assert isinstance(client, InferenceClient)
    first = await client.generate([5, 6, 7, 8, 9], GREEDY, request_id="r1")
    v0 = await client.weight_version()
    await client.pause("keep")
    await client.sleep(offload_kv=True)
    with pytest.raises(EngineStateError):
        await client.resume()
    await client.wake_up(["weights"])
    with pytest.raises(WeightUpdateError, match="missing"):
        await update_weights(client, weights[:2])
    version = await update_weights(client, weights, v0 + 3)
    await client.wake_up(["kv_cache"])
    await client.resume()
    reset = await client.reset_prefix_cache()
    second = await client.generate([5, 6, 7, 8, 9], GREEDY)
    with pytest.raises(InvalidRequestError):
        await client.generate([], GREEDY)
    with pytest.raises(InvalidRequestError):
        await client.generate([5], SamplingParams(temperature=-1.0))
    return {
        "first": first, "second": second, "version": version, "weight_version": await client.weight_version(),
        "reset": reset,
    }


def test_local_and_remote_clients_agree(serve, model_dir):
    server = serve()
    weights = list(load_file(str(model_dir / "model.safetensors")).items())

    async def local() -> dict:
        engine = AsyncEngine(LLMEngine(EngineConfig(model=str(model_dir), block_size=4)))
        try:
            return await lifecycle(LocalClient(engine), weights)
        finally:
            await engine.close()

    async def remote() -> dict:
        async with RemoteClient(server.url, control_token=server.control_token, chunk_bytes=50_000) as rc:
            return await lifecycle(rc, weights)  # small chunks: the update travels in several requests

    lo, re = asyncio.run(local()), asyncio.run(remote())
    for key in ("first", "second"):
        assert re[key].output_token_ids == lo[key].output_token_ids
        assert re[key].logprobs == pytest.approx(lo[key].logprobs, abs=1e-5)
        assert re[key].finish_reason == lo[key].finish_reason == "length"
    assert re["first"].request_id == "r1"
    assert lo["second"].token_weight_versions == re["second"].token_weight_versions == [3] * 6
    assert lo["version"] == re["version"] == lo["weight_version"] == re["weight_version"] == 3
    assert lo["reset"] is re["reset"] is True


def test_remote_generate_carries_the_prompt_logprobs(serve, model_dir, hf_model_factory):
    """prompt_logprobs=2 through `inflight serve`: RemoteClient hands over the server's prompt scores
    (each prompt token's logprob and rank, the 2 most likely) as they came, and they are
    transformers' log_softmax of the prompt's logits."""
    server = serve()
    prompt = [5, 17, 33, 40, 41, 200, 7]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, prompt_logprobs=2)

    async def go():
        async with RemoteClient(server.url, health_check_interval_s=None) as rc:
            out = await rc.generate(prompt, params)
        body = {"prompt_token_ids": prompt, "sampling_params": dataclasses.asdict(params)}
        sent = httpx.post(server.url + "/inflight/v1/generate", json=body, timeout=60).json()
        return out, sent

    out, sent = asyncio.run(go())
    assert (
        out.prompt_logprobs == sent["prompt_logprobs"]
        and out.prompt_logprob_ranks == sent["prompt_logprob_ranks"]
    )
    assert out.prompt_top_logprobs == [
        None if e is None else [tuple(p) for p in e] for e in sent["prompt_top_logprobs"]
    ]
    hf = hf_model_factory(model_dir)

    def scores(model) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([prompt])).logits[0, :-1].double(), -1)

    ref = scores(hf)
    with other_thread_count():  # what transformers itself moves by: float64, another thread count
        variants = [scores(copy.deepcopy(hf).double()), scores(hf)]
    pick = torch.tensor(prompt[1:])[:, None]
    expected = ref.gather(1, pick)[:, 0]
    assert out.prompt_logprobs[0] is None and out.prompt_top_logprobs[0] is None
    assert_close_to_reference(out.prompt_logprobs[1:], expected, [v.gather(1, pick)[:, 0] for v in variants],
                              "prompt logprobs")
    assert out.prompt_logprob_ranks == [None, *((ref > expected[:, None]).sum(-1) + 1).tolist()]
    top = ref.topk(2, -1)
    assert [[t for t, _ in entry] for entry in out.prompt_top_logprobs[1:]] == top.indices.tolist()
    assert_close_to_reference([[lp for _, lp in entry] for entry in out.prompt_top_logprobs[1:]], top.values,
                              [v.gather(1, top.indices) for v in variants], "prompt top logprobs")


def test_session_affinity_and_least_outstanding_over_two_servers(serve):
    a, b = serve(), serve()

    async def scenario() -> None:
        async with RemoteClient([a.url, b.url]) as rc:
            outs = await asyncio.gather(*(rc.generate([5, 6, 7], GREEDY) for _ in range(8)))
            assert all(len(o.output_token_ids) == 6 for o in outs)
            for turn in range(3):
                await rc.generate([9, 9, 9, turn], GREEDY, session_id="trajectory-7")
            assert set(rc.router.outstanding.values()) == {0}

    before = {s.url: s.engine.stats.finished_requests for s in (a, b)}
    asyncio.run(scenario())
    done = {s.url: s.engine.stats.finished_requests - before[s.url] for s in (a, b)}
    assert sum(done.values()) == 11
    assert min(done.values()) >= 4  # the 8 concurrent ones were spread
    assert sorted(done.values()) in ([4, 7], [5, 6])  # and the 3 session turns stayed together


def test_fan_out_fails_loudly_and_names_the_dead_server(serve):
    live = serve()
    dead = closed_port_url()

    async def scenario() -> None:
        async with RemoteClient([live.url, dead], control_token=live.control_token, retries=1,
                                backoff_s=0.01) as rc:
            with pytest.raises(FanOutError) as err:
                await rc.pause("keep")
            assert list(err.value.errors) == [dead] and dead in str(err.value) and "1 of 2" in str(err.value)
            assert isinstance(err.value.errors[dead], ServerUnavailableError)
            assert httpx.get(f"{live.url}/health").json()["paused"] is True  # the live one did pause
            with pytest.raises(FanOutError):
                await rc.weight_version()
        async with RemoteClient(live.url, control_token=live.control_token) as rc:
            await rc.resume()

    asyncio.run(scenario())


def test_generate_fails_over_when_a_server_refuses_connections(serve):
    live = serve()
    dead = closed_port_url()

    async def scenario() -> None:
        async with RemoteClient([dead, live.url], retries=2, backoff_s=0.01) as rc:
            outs = await asyncio.gather(*(rc.generate([5, 6, 7], GREEDY) for _ in range(4)))
            assert all(o.finish_reason == "length" and len(o.output_token_ids) == 6 for o in outs)
            assert rc.router.pick() == live.url  # the dead one is avoided for a while
            assert set(rc.router.outstanding.values()) == {0}
        async with RemoteClient([dead], retries=1, backoff_s=0.01) as rc:
            with pytest.raises(ServerUnavailableError, match="could not connect"):
                await rc.generate([5], GREEDY)

    asyncio.run(scenario())


def test_idempotent_calls_are_retried_with_backoff_and_others_are_not():
    calls: list[str] = []

    def flaky(request: httpx.Request) -> httpx.Response:
        calls.append(request.url.path)
        if request.url.path == "/pause" and len(calls) <= 2:
            raise httpx.ReadError("connection reset", request=request)
        if request.url.path == "/weight_update/finish":
            raise httpx.ReadError("connection reset", request=request)
        return httpx.Response(200, json={"success": True})

    async def scenario() -> float:
        rc = RemoteClient("http://mock", transport=httpx.MockTransport(flaky), retries=3, backoff_s=0.05)
        start = time.monotonic()
        await rc.pause("keep")  # two failures, then success
        elapsed = time.monotonic() - start
        assert calls == ["/pause"] * 3
        calls.clear()
        with pytest.raises(ServerUnavailableError, match="mid-request"):
            await rc.finish_weight_update(5)  # not idempotent: a lost answer is not re-sent
        assert calls == ["/weight_update/finish"]
        await rc.close()
        return elapsed

    elapsed = asyncio.run(scenario())
    assert elapsed >= 0.05 + 0.1  # backoff 0.05 then 0.1


def test_retries_are_bounded():
    calls: list[str] = []

    def down(request: httpx.Request) -> httpx.Response:
        calls.append(request.url.path)
        raise httpx.ConnectError("refused", request=request)

    async def scenario() -> None:
        async with RemoteClient("http://mock", transport=httpx.MockTransport(down), retries=2,
                                backoff_s=0.001) as rc:
            with pytest.raises(ServerUnavailableError, match="3 attempt"):
                await rc.resume()

    asyncio.run(scenario())
    assert calls == ["/resume"] * 3


async def _tcp_server(behaviour: str) -> tuple[asyncio.AbstractServer, str]:
    """A fake server that reads a request and then closes ('close') or never answers ('hang')."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.readuntil(b"\r\n\r\n")
            if behaviour == "hang":
                await asyncio.sleep(3600)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


@pytest.mark.parametrize("behaviour", ["close", "hang"])
def test_dead_or_hung_server_is_a_clear_error_not_a_hang(behaviour):
    async def scenario() -> float:
        server, url = await _tcp_server(behaviour)
        async with server, RemoteClient(url, health_check_interval_s=0.2) as rc:
            start = time.monotonic()
            with pytest.raises(ServerUnavailableError) as err:
                await asyncio.wait_for(rc.generate([5, 6], GREEDY), timeout=20)
            assert url in str(err.value)
            if behaviour == "hang":
                assert "stopped answering /health" in str(err.value)
            return time.monotonic() - start

    assert asyncio.run(scenario()) < 5.0
