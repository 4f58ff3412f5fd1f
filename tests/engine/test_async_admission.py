"""AsyncEngine admission never waits for the engine's lock (which a step holds for its whole
length): generate() and bad input return control to the event loop at once."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from inflight.engine import AsyncEngine, EngineConfig, InvalidRequestError, SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
HOLD_S = 2.0


def test_admission_and_bad_input_do_not_wait_for_a_running_step(tiny_model_factory):
    async def run():
        engine = AsyncEngine.from_config(EngineConfig(model=str(tiny_model_factory("qwen2")), block_size=4))
        held = threading.Event()

        def long_step():  # holds the engine's lock as a slow step would
            with engine.engine._lock:
                held.set()
                time.sleep(HOLD_S)

        threading.Thread(target=long_step, daemon=True).start()
        assert held.wait(10)
        start = time.monotonic()
        task = asyncio.create_task(engine.generate([5, 6, 7], GREEDY))
        await asyncio.sleep(0)  # generate() runs up to its first wait: the request is submitted
        with pytest.raises(InvalidRequestError, match="vocabulary"):
            await engine.generate([10**9], GREEDY)
        stalled = time.monotonic() - start
        output = await task
        await engine.close()
        return stalled, output

    stalled, output = asyncio.run(run())
    assert stalled < HOLD_S / 4 and len(output.output_token_ids) == 12
