"""AsyncEngine: an LLMEngine driven by a background step loop, with coroutine APIs.

The loop runs `engine.step()` in a worker thread while there is work and sleeps on an event
otherwise; control calls run in worker threads too and serialise with steps on the engine's lock.
The event loop itself never takes that lock (a step can hold it for a long time): `generate`
checks its input on the spot, then puts the request in an inbox that the worker thread moves into
the engine before the next step or control call; cancellations travel the same way.
`generate` simply awaits the request's final output, so a KEEP pause, a weight update and a resume
in between are invisible to the caller except in `token_weight_versions`.

Wake-ups cannot be lost: every change that may give the loop work (a submission, a cancellation, any
control call) bumps a change counter from the thread that made it, in a `finally`, so a control call
whose caller was cancelled or which raised still wakes the loop. The loop sleeps only when nothing
changed since it last looked, and even then re-checks every IDLE_RECHECK_S (a work found that way is a
missed wake-up: counted and logged). `health()` reports runnable work that no step has touched for
`stall_s` seconds; `status()` is the engine's `status()` with that health merged in.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Iterable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from inflight.engine.config import EngineConfig
from inflight.engine.engine import LLMEngine
from inflight.engine.errors import InvalidRequestError
from inflight.engine.lifecycle import EngineStatus
from inflight.engine.multimodal import MultimodalInput
from inflight.engine.request import RequestOutput, SamplingParams
from inflight.engine.step_threads import EngineThreads

Sink = asyncio.Future | asyncio.Queue  # where a request's output goes: a waiter or a stream
IDLE_RECHECK_S = 0.5  # an idle loop looks for work this often even when nothing woke it (the backstop)
STALL_S = 30.0  # runnable work that no step has touched for this long is reported by health()

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoopHealth:
    """The step loop as `AsyncEngine.health()` reports it."""

    step_loop: str  # "running" | "stopped"
    waiters: int  # engine requests that callers are waiting on
    seconds_since_step: float  # since the loop last looked for work
    stalled: bool  # runnable work has gone unstepped for stall_s, or callers wait on a stopped loop
    missed_wakeups: int
    threads: int | None  # torch threads the last step computed with (None: no step yet)


@dataclass(frozen=True)
class AsyncEngineStatus(EngineStatus):
    """`EngineStatus` with the step loop's health (`AsyncEngine.status()`)."""

    step_loop: LoopHealth


@dataclass
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_salt: str | None
    sink: Sink
    multimodal: MultimodalInput | None = None


@dataclass
class _Abort:
    request_id: str


class AsyncEngine:
    """Asynchronous front of one LLMEngine (same lifecycle, as coroutines)."""

    def __init__(self, engine: LLMEngine, stall_s: float = STALL_S,
                 threads: int | EngineThreads | None = None) -> None:
        if isinstance(threads, int) and threads < 1:
            raise ValueError(f"threads={threads}: an engine computes with at least 1 torch thread")
        self.engine = engine
        self.stall_s = stall_s
        # torch threads of the threads that step it (None: as they are; `EngineThreads`: its own
        # plus those its trainer lends it now, read at every step)
        self.threads = threads
        self._step_threads: int | None = None
        self._futures: dict[str, asyncio.Future[RequestOutput]] = {}
        self._streams: dict[str, asyncio.Queue[RequestOutput | Exception]] = {}
        self._wakeup: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._inbox: deque[_Add | _Abort] = deque()  # filled on the event loop, applied by a worker
        self._inbox_lock = threading.Lock()  # applies the inbox in order, from one thread at a time
        self._changes = 0  # bumped (from any thread) after each change that may give the loop work
        self._changes_lock = threading.Lock()
        self._last_progress = time.monotonic()  # when the loop last ran a step (or had nothing to do)
        self.missed_wakeups = 0  # work the idle backstop found that no wake-up announced
        # pause("wait") calls waiting for the drain's end
        self._drain_waiters: list[asyncio.Future[None]] = []

    @classmethod
    def from_config(cls, config: EngineConfig, stall_s: float = STALL_S,
                    threads: int | EngineThreads | None = None) -> AsyncEngine:
        """An AsyncEngine around a new LLMEngine built from `config`."""
        return cls(LLMEngine(config), stall_s, threads)

    def _use_threads(self) -> None:
        """Worker thread: compute with `threads` torch threads. torch's count is per thread (each
        thread's OpenMP setting), so every thread that steps the engine or runs a call sets its own."""
        wanted = self.threads.wanted() if isinstance(self.threads, EngineThreads) else self.threads
        if wanted is not None and torch.get_num_threads() != wanted:
            torch.set_num_threads(wanted)

    # ---- loop ---------------------------------------------------------------------------------
    def _ensure_started(self) -> None:
        if self._task is None or self._task.done():
            self._loop = asyncio.get_running_loop()
            self._wakeup = asyncio.Event()
            self._task = self._loop.create_task(self._run())

    def _notify(self) -> None:
        """Any thread: record a change that may give the loop work, and wake the loop."""
        self._bump()
        self._wake()

    def _bump(self) -> None:
        with self._changes_lock:
            self._changes += 1

    def _wake(self) -> None:
        loop, wakeup = self._loop, self._wakeup
        if loop is None or wakeup is None:
            return
        try:
            on_loop = asyncio.get_running_loop() is loop
        except RuntimeError:
            on_loop = False
        if on_loop:
            wakeup.set()
            return
        try:
            loop.call_soon_threadsafe(wakeup.set)
        except RuntimeError:  # the loop is closed: nobody is left to wake
            pass

    async def _run(self) -> None:
        backstop = False  # the last idle wait ran out without a wake-up
        while True:
            seen = self._changes  # read before the step thread looks for work
            try:
                ran, outputs, snapshots, changes = await asyncio.to_thread(self._step_once)
            except Exception as err:  # a failing step fails every waiter instead of hanging them
                self._fail_all(err)
                self._settle_drain()
                continue
            self._deliver(outputs, snapshots)
            self._settle_drain()
            if ran and backstop and changes == seen:
                self._count_missed_wakeup()
            backstop = False if ran else await self._idle(seen)

    async def _idle(self, seen: int) -> bool:
        """Sleep until a change after `seen` (at once if one happened already) or IDLE_RECHECK_S;
        returns True when the wait ran out without a wake-up."""
        assert self._wakeup is not None
        self._wakeup.clear()
        if self._changes != seen:
            return False
        try:
            # asyncio.timeout, not wait_for: on Python 3.11 wait_for drops a cancel that arrives in
            # the same turn as the wake-up, and the loop would outlive asyncio.run's shutdown
            async with asyncio.timeout(IDLE_RECHECK_S):
                await self._wakeup.wait()
        except TimeoutError:
            return self._changes == seen
        return False

    def _settle_drain(self) -> None:
        """On the loop, after each step or wake-up: release the pause("wait") calls once the drain
        has ended. Every way it ends (the last request finishing or aborted, a resume, another
        pause mode) is a step or a control call, and each control call wakes this loop."""
        if self._drain_waiters and not self.engine.is_draining:
            waiters, self._drain_waiters = self._drain_waiters, []
            for waiter in waiters:
                if not waiter.done():
                    waiter.set_result(None)

    def _count_missed_wakeup(self) -> None:
        self.missed_wakeups += 1
        logger.warning("the step loop found work that no wake-up announced (missed wake-up #%d); "
                       "something changed the engine behind the AsyncEngine", self.missed_wakeups)

    def _step_once(self) -> tuple[bool, list[RequestOutput], dict[str, RequestOutput], int]:
        """Worker thread: apply the inbox, run one step if there is work, snapshot the streams.
        Also returns the change counter as of the work check (read under the same lock)."""
        self._apply_inbox()
        self.engine.expire_weight_update()  # a dead sender's update must not freeze generation
        with self.engine.lock:
            work, changes = self.engine.has_work(), self._changes
        self._last_progress = time.monotonic()
        if not work:
            return False, [], {}, changes
        self._use_threads()
        self._step_threads = torch.get_num_threads()
        if isinstance(self.threads, EngineThreads):
            self.threads.stepped(self._step_threads)
        outputs = self.engine.step()
        self._last_progress = time.monotonic()
        snapshots = {}
        for request_id in tuple(self._streams):
            snapshot = self.engine.get_request_output(request_id)
            if snapshot is not None:
                snapshots[request_id] = snapshot
        return True, outputs, snapshots, changes

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
                        item.request_id, item.prompt_token_ids, item.params, item.cache_salt, item.multimodal
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
        multimodal: MultimodalInput | None = None,
    ) -> None:
        """Check the request now (bad input raises here), then queue it for the step thread."""
        if request_id in self._futures or request_id in self._streams:
            raise InvalidRequestError(f"request id {request_id!r} is already in use by an unfinished request")
        params = self.engine.check_request(prompt_token_ids, params, multimodal)
        if isinstance(sink, asyncio.Queue):
            self._streams[request_id] = sink
        else:
            self._futures[request_id] = sink
        self._inbox.append(_Add(request_id, list(prompt_token_ids), params, cache_salt, sink, multimodal))
        self._notify()

    def _cancel(self, request_id: str, sink: Sink) -> None:
        """If the request is still ours (registered, unfinished), forget it and have the step
        thread abort it."""
        sinks: dict[str, Any] = self._streams if isinstance(sink, asyncio.Queue) else self._futures
        if sinks.get(request_id) is not sink:
            return
        del sinks[request_id]
        self._inbox.append(_Abort(request_id))
        self._notify()

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
        """Stop the loop (requests still in the engine stay there; a pause("wait") still waiting
        returns: nothing would end its drain)."""
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        waiters, self._drain_waiters = self._drain_waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    # ---- requests -----------------------------------------------------------------------------
    async def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        cache_salt: str | None = None,
        multimodal: MultimodalInput | None = None,
    ) -> RequestOutput:
        """Add a request and wait for its final output (across any KEEP pause and weight update).
        Bad input raises before the first await. `multimodal`: the prompt's images."""
        self._ensure_started()
        request_id = request_id or uuid.uuid4().hex
        future: asyncio.Future[RequestOutput] = asyncio.get_running_loop().create_future()
        self._submit(request_id, prompt_token_ids, params, cache_salt, future, multimodal)
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
        multimodal: MultimodalInput | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield a snapshot after every step that ran the request; the last one is finished."""
        self._ensure_started()
        request_id = request_id or uuid.uuid4().hex
        queue: asyncio.Queue[RequestOutput | Exception] = asyncio.Queue()
        self._submit(request_id, prompt_token_ids, params, cache_salt, queue, multimodal)
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
        """Finish the given requests now (`finish_reason` 'abort'); returns their outputs."""
        return await self._call(self.engine.abort, list(request_ids))

    # ---- lifecycle ----------------------------------------------------------------------------
    async def _call(self, method, *args, **kwargs):
        """Run an engine call in a worker thread, after the requests submitted before it."""
        self._ensure_started()
        return await asyncio.to_thread(self._after_inbox, method, *args, **kwargs)

    def _after_inbox(self, method, *args, **kwargs):
        """Worker thread: apply the inbox, run the call, then wake the loop. The wake-up is issued
        here, not by the awaiting coroutine: the call takes effect even when that coroutine is
        cancelled (a caller's timeout, a client gone) or the call raises after changing state."""
        try:
            self._use_threads()
            self._apply_inbox()
            with self.engine.lock:  # the count moves with the change: a step that sees one sees both
                try:
                    return method(*args, **kwargs)
                finally:
                    self._bump()
        finally:
            self._wake()

    async def pause(self, mode: str = "keep") -> list[RequestOutput]:
        """Pause; with mode='wait' this returns once the in-flight requests have finished, or once
        the drain was ended otherwise (a resume or another pause mode), never later."""
        outputs = await self._call(self.engine.pause, mode)
        if self.engine.is_draining:  # woken by the loop when the drain ends (`_settle_drain`)
            waiter = asyncio.get_running_loop().create_future()
            self._drain_waiters.append(waiter)
            self._ensure_started()
            await waiter
        return outputs

    async def resume(self) -> None:
        """`LLMEngine.resume`: undo any pause."""
        await self._call(self.engine.resume)

    async def sleep(self, offload_kv: bool = False) -> None:
        """`LLMEngine.sleep`: free both pools (KV to host memory with `offload_kv`, else discarded)."""
        await self._call(self.engine.sleep, offload_kv)

    async def wake_up(self, tags: list[str] | None = None) -> None:
        """`LLMEngine.wake_up`: bring the named pools back (default both)."""
        await self._call(self.engine.wake_up, tags)

    async def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """`LLMEngine.reset_prefix_cache`: True iff the prefix cache is now empty."""
        return await self._call(self.engine.reset_prefix_cache, reset_running_requests)

    async def begin_weight_update(self) -> None:
        """`LLMEngine.begin_weight_update`: open an all-or-nothing update."""
        await self._call(self.engine.begin_weight_update)

    async def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """`LLMEngine.load_weights`: copy a chunk of HF-named tensors into the open update."""
        await self._call(self.engine.load_weights, list(named_tensors))

    async def finish_weight_update(self, version: int | None = None) -> int:
        """`LLMEngine.finish_weight_update`: complete the update; returns the new weight version."""
        return await self._call(self.engine.finish_weight_update, version)

    async def abort_weight_update(self) -> bool:
        """`LLMEngine.abort_weight_update`: True when the old weights are back."""
        return await self._call(self.engine.abort_weight_update)

    # ---- health -------------------------------------------------------------------------------
    def _loop_health(self) -> LoopHealth:
        started = self._task is not None and not self._task.done()
        waiters = len(self._futures) + len(self._streams)
        runnable = bool(self._inbox) or (self.engine.can_run and self.engine.scheduler.has_unfinished())
        since = time.monotonic() - self._last_progress
        stalled = (waiters > 0 and not started) or (runnable and since > self.stall_s)
        return LoopHealth("running" if started else "stopped", waiters, round(since, 3), stalled,
                          self.missed_wakeups, self._step_threads)

    def health(self) -> dict[str, Any]:
        """The step loop's state, read without the engine's lock: `stalled` is True when there is
        work the engine could run (or callers waiting on a loop that is not running) and no step
        has run for `stall_s` seconds. A paused engine's frozen requests are not stalled."""
        return asdict(self._loop_health())

    def status(self) -> AsyncEngineStatus:
        """The engine's `status()` plus the step loop's health; takes no lock (answers during a step)."""
        return AsyncEngineStatus(**vars(self.engine.status()), step_loop=self._loop_health())

    @property
    def weight_version(self) -> int:
        """The version of the weights the engine holds (bumped by every completed update)."""
        return self.engine.weight_version

    @property
    def stats(self):
        """The engine's counters (`EngineStats`)."""
        return self.engine.stats
