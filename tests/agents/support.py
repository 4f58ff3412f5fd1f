"""What the agent tests share: the engine's own record of every request (the oracle a session's
samples are checked against), and checks of a sample against it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from inflight.client.local import LocalClient
from inflight.engine.request import RequestOutput
from inflight.rollout.trajectory import ENV_VERSION


class EngineRecords(LocalClient):
    """A LocalClient that keeps every request's prompt and the engine's final output, in order."""

    def __init__(self, engine: Any) -> None:
        super().__init__(engine)
        self.outputs: list[RequestOutput] = []

    async def generate(
        self, prompt_token_ids, params=None, *, request_id=None, cache_salt=None, session_id=None
    ):
        out = await super().generate(prompt_token_ids, params, request_id=request_id, cache_salt=cache_salt,
                                     session_id=session_id)
        self.outputs.append(out)
        return out

    async def generate_stream(self, prompt_token_ids, params=None, *, request_id=None, cache_salt=None,
                              session_id=None) -> AsyncIterator[RequestOutput]:
        last = None
        try:
            async for snapshot in super().generate_stream(prompt_token_ids, params, request_id=request_id,
                                                          cache_salt=cache_salt, session_id=session_id):
                last = snapshot
                yield snapshot
        finally:
            if last is not None:
                self.outputs.append(last)


def assert_sample_is_the_engines(sample: Any, outputs: list[RequestOutput]) -> None:
    """Every run of sampled tokens (mask 1) of `sample` is one engine output verbatim (ids,
    log-probabilities, weight versions) of a request whose prompt was the sample's tokens before it;
    everything else in the response is observation (mask 0, version -1, log-probability 0)."""
    prompt, response = list(sample.prompt_ids), list(sample.response_ids)
    i = 0
    while i < len(response):
        if sample.loss_mask[i] == 0:
            assert sample.versions[i] == ENV_VERSION and sample.logprobs[i] == 0.0
            i += 1
            continue
        context = prompt + response[:i]
        n = next((j for j in range(i, len(response)) if sample.loss_mask[j] == 0), len(response)) - i
        segment = (response[i:i + n], sample.logprobs[i:i + n], sample.versions[i:i + n])
        matches = [o for o in outputs if list(o.prompt_token_ids) == context
                   and (list(o.output_token_ids), list(o.logprobs), list(o.token_weight_versions)) == segment]
        assert matches, f"no engine output for the sampled tokens at position {i} of the response"
        i += n


def run(coro: Any) -> Any:
    return asyncio.run(coro)
