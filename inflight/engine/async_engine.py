"""AsyncEngine: an LLMEngine driven by a background step loop, with coroutine APIs.

The loop runs `engine.step()` in a worker thread while there is work and sleeps on an event
otherwise; control calls run in worker threads too and serialise with steps on the engine's lock.
The event loop itself never takes that lock (a step can hold it for a long time): `generate`
checks its input on the spot, then puts the request in an inbox that the worker thread moves into
the engine before the next step or control call; cancellations travel the same way.
`generate` simply awaits the request's final output, so a KEEP pause, a weight update and a resume
in between are invisible to the caller except in `token_weight_versions`.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections import deque
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from inflight.engine.config import EngineConfig
from inflight.engine.engine import LLMEngine
from inflight.engine.errors import InvalidRequestError
from inflight.engine.request import RequestOutput, SamplingParams

Sink = asyncio.Future | asyncio.Queue  # where a request's output goes: a waiter or a stream


@dataclass
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_salt: str | None
    sink: Sink


@dataclass
class _Abort:
    request_id: str


class AsyncEngine:
    """Asynchronous front of one LLMEngine (same lifecycle, as coroutines)."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._futures: dict[str, asyncio.Future[RequestOutput]] = {}
        self._streams: dict[str, asyncio.Queue[RequestOutput | Exception]] = {}
        self._wakeup: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._inbox: deque[_Add | _Abort] = deque()  # filled on the event loop, applied by a worker
        self._inbox_lock = threading.Lock()  # applies the inbox in order, from one thread at a time

    @classmethod
    def from_config(cls, config: EngineConfig) -> AsyncEngine:
        return cls(LLMEngine(config))

    # ---- loop ---------------------------------------------------------------------------------
    def _ensure_started(self) -> None:
        if self._task is None or self._task.done():
            self._loop = asyncio.get_running_loop()
            self._wakeup = asyncio.Event()
            self._task = self._loop.create_task(self._run())

    def _kick(self) -> None:
        if self._wakeup is not None:
            self._wakeup.set()

    async def _run(self) -> None:
        assert self._wakeup is not None
        while True:
            self._wakeup.clear()
            try:
                ran, outputs, snapshots = await asyncio.to_thread(self._step_once)
            except Exception as err:  # a failing step fails every waiter instead of hanging them
                self._fail_all(err)
                continue
            self._deliver(outputs, snapshots)
            if not ran:
                await self._wakeup.wait()

    def _step_once(self) -> tuple[bool, list[RequestOutput], dict[str, RequestOutput]]:
        """Worker thread: apply the inbox, run one step if there is work, snapshot the streams."""
        self._apply_inbox()
        if not self.engine.has_work():
            return False, [], {}
        outputs = self.engine.step()
        snapshots = {}
        for request_id in tuple(self._streams):
            snapshot = self.engine.get_request_output(request_id)
            if snapshot is not None:
                snapshots[request_id] = snapshot
        return True, outputs, snapshots

    def _apply_inbox(self) -> None:
        """Worker thread: move queued requests into the engine and abort cancelled ones, in order."""
        with self._inbox_lock:
            while self._inbox:
                item = self._inbox.popleft()
                if isinstance(item, _Abort):
                    self.engine.abort([item.request_id])
                    continue
                try:
                    self.engine.add_request(
                        item.request_id, item.prompt_token_ids, item.params, item.cache_salt
                    )
                except Exception as err:  # only what the up-front check cannot see (e.g. a reused id)
                    assert self._loop is not None
                    self._loop.call_soon_threadsafe(self._reject, item, err)

    def _submit(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams | None,
        cache_salt: str | None,
        sink: Sink,
    ) -> None:
        """Check the request now (bad input raises here), then queue it for the step thread."""
        if request_id in self._futures or request_id in self._streams:
            raise InvalidRequestError(f"request id {request_id!r} is already in use by an unfinished request")
        params = self.engine.check_request(prompt_token_ids, params)
        if isinstance(sink, asyncio.Queue):
            self._streams[request_id] = sink
        else:
            self._futures[request_id] = sink
        self._inbox.append(_Add(request_id, list(prompt_token_ids), params, cache_salt, sink))
        self._kick()

    def _cancel(self, request_id: str, sink: Sink) -> None:
        """If the request is still ours (registered, unfinished), forget it and have the step
        thread abort it."""
        sinks: dict[str, Any] = self._streams if isinstance(sink, asyncio.Queue) else self._futures
        if sinks.get(request_id) is not sink:
            return
        del sinks[request_id]
        self._inbox.append(_Abort(request_id))
        self._kick()

    def _reject(self, item: _Add, err: Exception) -> None:
        sinks: dict[str, Any] = self._streams if isinstance(item.sink, asyncio.Queue) else self._futures
        if sinks.get(item.request_id) is item.sink:
            del sinks[item.request_id]
        if isinstance(item.sink, asyncio.Queue):
            item.sink.put_nowait(err)
        elif not item.sink.done():
            item.sink.set_exception(err)

    def _deliver(self, outputs: list[RequestOutput], snapshots: dict[str, RequestOutput]) -> None:
        for request_id, snapshot in snapshots.items():
            queue = self._streams.get(request_id)
            if queue is not None:
                queue.put_nowait(snapshot)
        for output in outputs:
            future = self._futures.pop(output.request_id, None)
            if future is not None and not future.done():
                future.set_result(output)
            queue = self._streams.pop(output.request_id, None)
            if queue is not None:
                queue.put_nowait(output)

    def _fail_all(self, err: Exception) -> None:
        for future in self._futures.values():
            if not future.done():
                future.set_exception(err)
        self._futures.clear()
        for queue in self._streams.values():
            queue.put_nowait(err)

    async def close(self) -> None:
        """Stop the loop (requests still in the engine stay there)."""
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None

    # ---- requests -----------------------------------------------------------------------------
    async def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        cache_salt: str | None = None,
    ) -> RequestOutput:
        """Add a request and wait for its final output (across any KEEP pause and weight update).
        Bad input raises before the first await."""
        self._ensure_started()
        request_id = request_id or uuid.uuid4().hex
        future: asyncio.Future[RequestOutput] = asyncio.get_running_loop().create_future()
        self._submit(request_id, prompt_token_ids, params, cache_salt, future)
        try:
            return await future
        except asyncio.CancelledError:
            self._cancel(request_id, future)
            raise

    async def generate_stream(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        cache_salt: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield a snapshot after every step that ran the request; the last one is finished."""
        self._ensure_started()
        request_id = request_id or uuid.uuid4().hex
        queue: asyncio.Queue[RequestOutput | Exception] = asyncio.Queue()
        self._submit(request_id, prompt_token_ids, params, cache_salt, queue)
        try:
            while True:
                output = await queue.get()
                if isinstance(output, Exception):
                    raise output
                yield output
                if output.finished:
                    return
        finally:
            self._cancel(request_id, queue)

    async def abort(self, request_ids: Iterable[str]) -> list[RequestOutput]:
        return await self._call(self.engine.abort, list(request_ids))

    # ---- lifecycle ----------------------------------------------------------------------------
    async def _call(self, method, *args, **kwargs):
        """Run an engine call in a worker thread, after the requests submitted before it."""
        result = await asyncio.to_thread(self._after_inbox, method, *args, **kwargs)
        self._kick()
        return result

    def _after_inbox(self, method, *args, **kwargs):
        self._apply_inbox()
        return method(*args, **kwargs)

    async def pause(self, mode: str = "keep") -> list[RequestOutput]:
        """Pause; with mode='wait' this returns once the in-flight requests have finished."""
        outputs = await self._call(self.engine.pause, mode)
        while not self.engine.is_paused:
            await asyncio.sleep(0.005)
        return outputs

    async def resume(self) -> None:
        await self._call(self.engine.resume)

    async def sleep(self, offload_kv: bool = False) -> None:
        await self._call(self.engine.sleep, offload_kv)

    async def wake_up(self, tags: list[str] | None = None) -> None:
        await self._call(self.engine.wake_up, tags)

    async def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        return await self._call(self.engine.reset_prefix_cache, reset_running_requests)

    async def begin_weight_update(self) -> None:
        await self._call(self.engine.begin_weight_update)

    async def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        await self._call(self.engine.load_weights, list(named_tensors))

    async def finish_weight_update(self, version: int | None = None) -> int:
        return await self._call(self.engine.finish_weight_update, version)

    async def abort_weight_update(self) -> bool:
        return await self._call(self.engine.abort_weight_update)

    @property
    def weight_version(self) -> int:
        return self.engine.weight_version

    @property
    def stats(self):
        return self.engine.stats
