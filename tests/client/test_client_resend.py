"""A generation request whose connection breaks after it was sent (the keep-alive race a training
run on vLLM died of) is sent once more when the server still answers /health: the real server aborts
the orphan and the answer equals an undisturbed request's. A dead server, or a request with a
chosen id, still fails with ServerUnavailableError."""

from __future__ import annotations

import asyncio
import time

import pytest

from inflight.client import RemoteClient, ServerUnavailableError, wire
from inflight.engine import SamplingParams
from inflight.testing.breaking_proxy import BreakingProxy

LONG = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)


async def _settled(engine, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not engine.engine.has_unfinished_requests():
            return True
        await asyncio.sleep(0.02)
    return False


def test_a_request_whose_connection_broke_is_sent_again_and_answered_once(serve):
    srv = serve()

    async def scenario() -> None:
        async with RemoteClient(srv.url) as direct:
            expected = await direct.generate([5, 6, 7, 8, 9], LONG)
        proxy = BreakingProxy(srv.port, wire.GENERATE)
        url = await proxy.start()
        async with proxy.server, RemoteClient(url) as rc:
            output = await rc.generate([5, 6, 7, 8, 9], LONG)
        assert (proxy.broken, proxy.generations) == (1, 2)
        assert output.output_token_ids == expected.output_token_ids
        assert output.logprobs == pytest.approx(expected.logprobs, abs=1e-5)
        assert await _settled(srv.engine)  # the orphan was aborted or finished: nothing left running

    asyncio.run(scenario())


def test_a_request_with_a_chosen_id_is_not_sent_again(serve):
    srv = serve()

    async def scenario() -> None:
        proxy = BreakingProxy(srv.port, wire.GENERATE)
        url = await proxy.start()
        async with proxy.server, RemoteClient(url) as rc:
            with pytest.raises(ServerUnavailableError, match="mid-request"):
                await rc.generate([5, 6, 7, 8, 9], LONG, request_id="mine")
        assert proxy.generations == 1
        assert await _settled(srv.engine)

    asyncio.run(scenario())
