"""abort_weight_update through LocalClient and RemoteClient puts the engine back on its old weights."""

from __future__ import annotations

import asyncio

import pytest

from inflight.client.local import LocalClient
from inflight.engine import AsyncEngine, EngineConfig, SamplingParams, WeightUpdateError
from inflight.engine.models.loader import iter_safetensors

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def test_local_client_abort_restores_old_weights(tiny_model_factory):
    model_a, model_b = tiny_model_factory("qwen2", seed=0), tiny_model_factory("qwen2", seed=1)

    async def run():
        client = LocalClient(AsyncEngine.from_config(EngineConfig(model=str(model_a), block_size=4)))
        before = await client.generate([5, 6, 7], GREEDY)
        await client.pause("keep")
        await client.begin_weight_update()
        weights_b = list(iter_safetensors(model_b))
        await client.load_weights(weights_b[:4])
        with pytest.raises(WeightUpdateError):
            await client.finish_weight_update(1)  # incomplete
        assert await client.abort_weight_update() is True
        await client.resume()
        after = await client.generate([5, 6, 7], GREEDY)
        version = await client.weight_version()
        await client.close()
        return before, after, version

    before, after, version = asyncio.run(run())
    assert after.output_token_ids == before.output_token_ids and version == 0


def test_remote_client_abort_restores_old_weights(serve, tiny_model_factory):
    from inflight.client.remote import RemoteClient

    server = serve()
    weights_b = list(iter_safetensors(tiny_model_factory("qwen2", seed=1)))

    async def run():
        async with RemoteClient(server.url, control_token=server.control_token) as client:
            before = await client.generate([5, 6, 7], GREEDY)
            await client.pause("keep")
            await client.begin_weight_update()
            await client.load_weights(weights_b[:4])
            restored = await client.abort_weight_update()
            await client.resume()
            after = await client.generate([5, 6, 7], GREEDY)
            return before, after, restored, await client.weight_version()

    before, after, restored, version = asyncio.run(run())
    assert restored is True and version == 0
    assert after.output_token_ids == before.output_token_ids
