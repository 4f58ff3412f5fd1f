"""AsyncEngine: concurrent generate, streaming, and a generate that spans a KEEP pause + update."""

from __future__ import annotations

import asyncio

from inflight.engine import AsyncEngine, EngineConfig, LLMEngine, SamplingParams
from inflight.engine.models.loader import iter_safetensors

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 6, 7], list(range(10, 40)), [100] * 9]


def test_concurrent_generate_equals_sync(tiny_model_factory):
    model_dir = str(tiny_model_factory("qwen2"))
    expected = LLMEngine(EngineConfig(model=model_dir, block_size=4)).generate(PROMPTS, GREEDY)

    async def run():
        engine = AsyncEngine.from_config(EngineConfig(model=model_dir, block_size=4))
        outs = await asyncio.gather(*(engine.generate(p, GREEDY) for p in PROMPTS))
        await engine.close()
        return outs

    outs = asyncio.run(run())
    assert [o.output_token_ids for o in outs] == [o.output_token_ids for o in expected]


def test_generate_spans_keep_pause_and_update(tiny_model_factory):
    model_dir = tiny_model_factory("qwen2")

    async def run():
        engine = AsyncEngine.from_config(EngineConfig(model=str(model_dir), block_size=4))
        params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
        task = asyncio.create_task(engine.generate(PROMPTS[1], params, request_id="long"))
        while (snap := engine.engine.get_request_output("long")) is None or len(snap.output_token_ids) < 3:
            await asyncio.sleep(0.001)
        await engine.pause("keep")
        status = engine.status()
        assert status.paused and status.num_frozen == 1 and status.step_loop.waiters == 1
        assert not status.step_loop.stalled and status.step_loop.step_loop == "running"
        frozen = len(engine.engine.get_request_output("long").output_token_ids)
        await asyncio.sleep(0.05)
        assert len(engine.engine.get_request_output("long").output_token_ids) == frozen
        assert not task.done()
        await engine.begin_weight_update()
        await engine.load_weights(iter_safetensors(model_dir))  # same weights, new version
        assert await engine.finish_weight_update(7) == 7
        await engine.resume()
        out = await task
        await engine.close()
        return frozen, out

    frozen, out = asyncio.run(run())
    assert out.finish_reason == "length" and len(out.output_token_ids) == 40
    assert out.token_weight_versions == [0] * frozen + [7] * (40 - frozen)


def test_streaming_yields_growing_snapshots(tiny_model_factory):
    async def run():
        engine = AsyncEngine.from_config(EngineConfig(model=str(tiny_model_factory("qwen2")), block_size=4))
        sizes = [len(s.output_token_ids) async for s in engine.generate_stream(PROMPTS[0], GREEDY)]
        await engine.close()
        return sizes

    sizes = asyncio.run(run())
    assert sizes == sorted(sizes) and sizes[-1] == 12 and len(sizes) >= 6


def test_cancelled_generate_aborts_request(tiny_model_factory):
    async def run():
        engine = AsyncEngine.from_config(EngineConfig(model=str(tiny_model_factory("qwen2")), block_size=4))
        await engine.pause("keep")
        task = asyncio.create_task(engine.generate(PROMPTS[0], GREEDY, request_id="c"))
        await asyncio.sleep(0.01)
        task.cancel()
        await asyncio.sleep(0.01)
        unfinished = engine.engine.has_unfinished_requests()
        await engine.close()
        return unfinished, engine.stats.aborted_requests

    unfinished, aborted = asyncio.run(run())
    assert not unfinished and aborted == 1


def test_a_failing_step_fails_waiters_and_streams(tiny_model_factory, monkeypatch):
    async def run():
        engine = AsyncEngine.from_config(EngineConfig(model=str(tiny_model_factory("qwen2")), block_size=4))

        def broken_step():
            raise RuntimeError("boom")

        monkeypatch.setattr(engine.engine, "step", broken_step)
        waiter = asyncio.create_task(engine.generate(PROMPTS[0], GREEDY))

        async def consume():
            return [s async for s in engine.generate_stream(PROMPTS[1], GREEDY)]

        streamer = asyncio.create_task(consume())
        results = await asyncio.wait_for(asyncio.gather(waiter, streamer, return_exceptions=True), timeout=10)
        await engine.close()
        return results

    results = asyncio.run(run())
    assert all(isinstance(r, RuntimeError) and str(r) == "boom" for r in results)
