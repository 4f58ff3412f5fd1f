"""`ticking`, the one wait behind SSE keep-alives and disconnect polling: a None per idle period,
the pending item never lost to a tick, and closing it cancels the wait (which closes the source)."""

from __future__ import annotations

import asyncio
import contextlib

from inflight.server.generation import ticking


async def slow_items(gate: asyncio.Event, closed: list[bool]):
    try:
        yield "a"
        await gate.wait()
        yield "b"
    finally:
        closed.append(True)


def test_ticks_while_waiting_and_keeps_the_pending_item():
    async def main():
        gate, closed, seen = asyncio.Event(), [], []
        async for item in ticking(slow_items(gate, closed), 0.01):
            seen.append(item)
            if seen.count(None) == 3:
                gate.set()
        return seen, closed

    seen, closed = asyncio.run(main())
    assert seen[0] == "a" and seen[-1] == "b" and set(seen[1:-1]) == {None} and len(seen) >= 5
    assert closed == [True]


def test_closing_cancels_the_wait_and_closes_the_source():
    async def main():
        gate, closed = asyncio.Event(), []
        async with contextlib.aclosing(ticking(slow_items(gate, closed), 0.01)) as items:
            assert [await anext(items), await anext(items)] == ["a", None]  # now waiting for "b"
        return closed

    assert asyncio.run(main()) == [True]
