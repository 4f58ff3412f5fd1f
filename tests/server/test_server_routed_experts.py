"""An MoE model's routing record over the HTTP token route: `RemoteClient.generate` returns the
same `routed_experts` array (dtype, shape, start) as the engine in process."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from inflight.client import RemoteClient
from inflight.engine import EngineConfig, LLMEngine, SamplingParams
from inflight.server.launch import serve_model


@pytest.fixture(scope="module")
def moe_dir(tiny_model_factory):
    return tiny_model_factory("qwen3_moe", num_hidden_layers=2)


@pytest.fixture(scope="module")
def moe_server(moe_dir):
    srv = serve_model(EngineConfig(model=str(moe_dir), block_size=4), "tiny-moe", control_token="secret")
    yield srv
    srv.stop()


@pytest.mark.parametrize("prompt_too", [False, True])
def test_token_route_returns_the_routing_record(moe_dir, moe_server, prompt_too):
    prompt = [5, 9, 200, 31, 8, 77, 150, 12, 40]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, return_routed_experts=prompt_too)
    want = LLMEngine(EngineConfig(model=str(moe_dir), block_size=4)).generate([prompt], params)[0]

    async def remote():
        async with RemoteClient(moe_server.url, retries=0) as client:
            return await client.generate(prompt, params)

    got = asyncio.run(remote())
    assert got.output_token_ids == want.output_token_ids
    assert got.routed_experts.dtype == np.uint8 and got.routed_experts.shape == (
        len(prompt) + 5 if prompt_too else 6,
        2,
        2,
    )
    assert got.routed_experts_start == want.routed_experts_start == (0 if prompt_too else len(prompt) - 1)
    np.testing.assert_array_equal(got.routed_experts, want.routed_experts)
