"""Running the engine requests behind one API call (one per prompt and choice) and turning their
outputs into `Delta`s.

Every engine request is added before anything is awaited, so input the engine rejects fails the call
up front (a 4xx before any response byte) and the requests already added are aborted. A call whose
client goes away is aborted too: streams by their consumer closing, others by polling the
connection while they wait.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from inflight.engine.request import RequestOutput, SamplingParams
from inflight.server.backend import Backend
from inflight.server.detokenize import ChoiceTracker, Delta
from inflight.server.errors import APIError

DISCONNECT_POLL_S = 1.0
ACCEPTED = -1  # index of the first delta of `_run`: every engine request was accepted
T = TypeVar("T")


class ClientDisconnected(APIError):
    """The HTTP client went away; its engine requests were aborted."""

    def __init__(self) -> None:
        super().__init__(499, "client disconnected", code="client_disconnected")


@dataclass
class EngineCall:
    """One engine request: what to generate and the tracker that turns its outputs into deltas."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_salt: str | None
    tracker: ChoiceTracker
    multimodal: Any = None  # the prompt's images (`engine.multimodal.MultimodalInput`), passed only when set


async def _settle(tasks: list[asyncio.Future]) -> None:
    """Let the just-created tasks run up to their first wait; re-raise the first that failed
    (after cancelling the others, which aborts their engine requests)."""
    await asyncio.sleep(0)
    failed = next((t for t in tasks if t.done() and not t.cancelled() and t.exception() is not None), None)
    if failed is not None:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise failed.exception()  # type: ignore[misc]


async def start_calls(engine: Backend, calls: list[EngineCall], stream: bool,
                      is_disconnected: Callable[[], Awaitable[bool]] | None = None) -> AsyncIterator[Delta]:
    """Add every call's engine request (input the engine rejects raises here, and none stays added);
    returns the deltas of all calls as they come, the last delta of each with its finish_reason.

    With `is_disconnected`, the connection is polled while waiting and a client that went away
    raises ClientDisconnected (its requests are aborted).
    """
    deltas = _run(engine, calls, stream, is_disconnected)
    assert (await anext(deltas)).index == ACCEPTED
    return deltas


async def finish_calls(deltas: AsyncIterator[Delta]) -> None:
    """Drain the deltas (the trackers hold the results)."""
    async for _ in deltas:
        pass


async def _run(engine: Backend, calls: list[EngineCall], stream: bool,
               is_disconnected: Callable[[], Awaitable[bool]] | None) -> AsyncIterator[Delta]:
    source = _merged(engine, calls, stream or any(c.tracker.stop for c in calls))
    try:
        yield await anext(source)
        if is_disconnected is None:  # nothing to poll (streams notice a disconnect when they write)
            async for delta in source:
                yield delta
            return
        async with contextlib.aclosing(ticking(source, DISCONNECT_POLL_S)) as deltas:
            async for delta in deltas:
                if delta is not None:
                    yield delta
                elif await is_disconnected():
                    raise ClientDisconnected()
    finally:
        await source.aclose()


async def ticking(items: AsyncIterator[T], period_s: float) -> AsyncIterator[T | None]:
    """The items, with a None whenever `period_s` pass without one. A pending step is never
    abandoned (a tick only reports the wait); closing this cancels it, which closes `items`."""
    step: asyncio.Future[T] | None = None
    try:
        while True:
            step = step or asyncio.ensure_future(anext(items))
            done, _ = await asyncio.wait({step}, timeout=period_s)
            if not done:
                yield None
                continue
            try:
                item = step.result()
            except StopAsyncIteration:
                return
            step = None
            yield item
    finally:
        if step is not None:
            step.cancel()
            await asyncio.gather(step, return_exceptions=True)


async def _once(output: Awaitable[RequestOutput]) -> AsyncIterator[RequestOutput]:
    yield await output


async def _merged(engine: Backend, calls: list[EngineCall], stream: bool) -> AsyncIterator[Delta]:
    """The calls' deltas in the order they come: from every step's snapshot when streaming (or
    watching for stop strings), else from each final output alone."""
    run = engine.generate_stream if stream else lambda *args, **kw: _once(engine.generate(*args, **kw))
    streams = [run(c.prompt_token_ids, c.params, request_id=c.request_id, cache_salt=c.cache_salt,
                   **({} if c.multimodal is None else {"multimodal": c.multimodal})) for c in calls]
    firsts = [asyncio.ensure_future(anext(s)) for s in streams]
    queue: asyncio.Queue[tuple[int, RequestOutput | None, BaseException | None]] = asyncio.Queue()

    async def pump(i: int) -> None:
        try:
            snapshot = await firsts[i]
            queue.put_nowait((i, snapshot, None))
            while not snapshot.finished:
                snapshot = await anext(streams[i])
                queue.put_nowait((i, snapshot, None))
        except Exception as err:
            queue.put_nowait((i, None, err))

    pumps: list[asyncio.Task] = []
    try:
        await _settle(firsts)
        yield Delta(ACCEPTED, "", [], None, [], None)
        pumps = [asyncio.ensure_future(pump(i)) for i in range(len(calls))]
        remaining = len(calls)
        while remaining:
            i, snapshot, err = await queue.get()
            if err is not None:
                raise err
            assert snapshot is not None
            tracker = calls[i].tracker
            if tracker.finish_reason is not None:
                continue
            delta = tracker.update(snapshot)
            if tracker.stopped:
                pumps[i].cancel()  # its generate_stream aborts the engine request
            if delta.finish_reason is not None:
                remaining -= 1
            yield delta
    finally:
        for t in [*firsts, *pumps]:
            t.cancel()
        await asyncio.gather(*firsts, *pumps, return_exceptions=True)
        for s in streams:
            await s.aclose()


__all__ = ["ClientDisconnected", "EngineCall", "finish_calls", "start_calls", "ticking"]
