"""FanOutClient over real in-process engines: generation spread by outstanding requests and kept on
one engine per session (its prefix cache hits), control calls and weights reaching every engine,
versions that must agree, summed counters, one engine's error passed through unchanged, and one
weight broadcast group over every engine (or a NotImplementedError naming the alternatives)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from inflight.client import FanOutError, InconsistentServersError, LocalClient, update_weights
from inflight.client.fanout import FanOutClient
from inflight.client.ops import JoiningClient, apply_op
from inflight.engine import AsyncEngine, EngineConfig, EngineStateError, LLMEngine, SamplingParams
from inflight.engine.models.loader import iter_safetensors

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def _run(model_dir, body, n: int = 2, **overrides):
    async def main():
        engines = [
            AsyncEngine(LLMEngine(EngineConfig(model=str(model_dir), block_size=4, seed=i, **overrides)))
            for i in range(n)
        ]
        try:
            return await body(FanOutClient([LocalClient(e) for e in engines]), [e.engine for e in engines])
        finally:
            await asyncio.gather(*(e.close() for e in engines))

    return asyncio.run(main())


def test_requests_spread_by_outstanding_count(model_dir):
    async def body(client, engines):
        await asyncio.gather(*(client.generate([5, 6, 7 + i], GREEDY) for i in range(8)))
        return [e.stats.finished_requests for e in engines], client.router.outstanding

    finished, outstanding = _run(model_dir, body)
    assert finished == [4, 4] and set(outstanding.values()) == {0}


def test_a_session_stays_on_its_engine_and_hits_its_prefix_cache(model_dir):
    prompt = list(range(5, 21))  # four full blocks of 4

    async def body(client, engines):
        first = await client.generate(prompt, GREEDY, session_id="traj")
        long = SamplingParams(max_tokens=40, ignore_eos=True)
        busy = asyncio.create_task(client.generate([9, 9, 9], long, session_id="traj"))
        await asyncio.sleep(0)  # the session's engine is now the busier one, yet it gets the next turn
        second = await client.generate(prompt + first.output_token_ids, GREEDY, session_id="traj")
        await busy
        name = client.router.session_server("traj")
        return second, [e.stats.finished_requests for e in engines], int(name[-1])

    second, finished, index = _run(model_dir, body)
    assert second.num_cached_tokens >= len(prompt)
    assert finished[index] == 3 and finished[1 - index] == 0


def test_weights_and_control_reach_every_engine(model_dir, tiny_model_factory):
    weights_b = list(iter_safetensors(tiny_model_factory("qwen2", seed=1)))

    async def body(client, engines):
        before = [await c.generate([5, 6, 7], GREEDY) for c in client.clients.values()]
        await client.pause("keep")
        assert all(e.is_paused for e in engines)
        version = await update_weights(client, iter(weights_b), version=3)  # an iterator: used once
        await client.resume()
        after = [await c.generate([5, 6, 7], GREEDY) for c in client.clients.values()]
        return before, after, version, await client.weight_versions(), await client.stats()

    before, after, version, versions, stats = _run(model_dir, body)
    assert version == 3 and versions == {"engine-0": 3, "engine-1": 3}
    assert after[0].output_token_ids == after[1].output_token_ids != before[0].output_token_ids
    assert stats["weight_updates"] == 2 and stats["pauses"] == 2 and stats["finished_requests"] == 4


def test_engines_at_different_versions_are_reported(model_dir, tiny_model_factory):
    weights = list(iter_safetensors(model_dir))

    async def body(client, engines):
        await update_weights(client.clients["engine-1"], weights, version=1)
        with pytest.raises(InconsistentServersError, match="different weight versions"):
            await client.weight_version()
        return await client.weight_versions()

    assert _run(model_dir, body) == {"engine-0": 0, "engine-1": 1}


def test_one_engine_raises_its_own_error(model_dir):
    async def body(client, engines):
        await client.sleep()
        with pytest.raises(EngineStateError, match="asleep"):
            await client.resume()

    _run(model_dir, body, n=1)


class InProcessOpClient(JoiningClient):
    """The process / Ray engine client's calls, run on an in-process engine (`apply_op`)."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine

    async def _call(self, op, *args):
        return await apply_op(self.engine, op, *args)


def _weights_of(engine) -> dict[str, torch.Tensor]:
    params = dict(engine.model.named_parameters())
    return {n: params[engine.model.resolve(n)].detach().clone() for n in engine.model.hf_parameter_names()}


def test_broadcast_over_clients_that_cannot_join_names_the_alternatives(model_dir):
    async def body(client, engines):
        with pytest.raises(NotImplementedError, match="engine-0 \\(LocalClient\\).*RemoteClient.*broadcast"):
            await client.init_weight_transfer()
        with pytest.raises(RuntimeError, match="init_weight_transfer"):
            await client.update_weights_broadcast([])

    _run(model_dir, body)


def test_one_broadcast_group_over_every_engine(model_dir, tiny_model_factory):
    """Two engines joined through their op clients (ranks 1 and 2): each chunk's bytes in one
    broadcast (64 KiB chunks: some tensors in pieces); a refused update keeps the old weights and
    the group in step; after closing, no group."""
    new = list(iter_safetensors(tiny_model_factory("qwen2", seed=1)))
    wrong = [(n, torch.zeros(t.numel() + 1) if n == "model.norm.weight" else t) for n, t in new]

    async def body(local, engines):
        client = FanOutClient([InProcessOpClient(c.engine) for c in local.clients.values()])
        info = await client.init_weight_transfer(max_chunk_bytes=64 * 1024, timeout_s=60)
        version = await client.update_weights_broadcast(new, version=4)
        updated = [_weights_of(e) for e in engines]
        with pytest.raises(FanOutError, match="size mismatch|shape"):
            await client.update_weights_broadcast(wrong, version=5)
        kept = await client.weight_versions(), [_weights_of(e) for e in engines]
        again = await client.update_weights_broadcast(new)  # the group is still in step
        await client.close_weight_transfer()
        with pytest.raises(RuntimeError, match="init_weight_transfer"):
            await client.update_weights_broadcast(new)
        return info, version, updated, kept, again

    info, version, updated, (versions, kept), again = _run(model_dir, body)
    assert info["world_size"] == 3 and info["ranks"] == {"engine-0": 1, "engine-1": 2}
    expected = dict(new)
    for weights in updated + kept:
        assert weights.keys() == expected.keys() and all(
            torch.equal(weights[n], expected[n]) for n in weights
        )
    assert version == 4 and versions == {"engine-0": 4, "engine-1": 4} and again == 5
