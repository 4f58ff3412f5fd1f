"""AsyncEngine: an LLMEngine driven by a background step loop, with coroutine APIs.

The loop runs `engine.step()` in a worker thread while there is work and sleeps on an event
otherwise; control calls run in worker threads too and serialise with steps on the engine's lock.
`generate` simply awaits the request's final output, so a KEEP pause, a weight update and a resume
in between are invisible to the caller except in `token_weight_versions`.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Iterable

import torch

from inflight.engine.config import EngineConfig
from inflight.engine.engine import LLMEngine
from inflight.engine.request import RequestOutput, SamplingParams


class AsyncEngine:
    """Asynchronous front of one LLMEngine (same lifecycle, as coroutines)."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._futures: dict[str, asyncio.Future[RequestOutput]] = {}
        self._streams: dict[str, asyncio.Queue[RequestOutput | Exception]] = {}
        self._wakeup: asyncio.Event | None = None
        self._task: asyncio.Task | None = None

    @classmethod
    def from_config(cls, config: EngineConfig) -> AsyncEngine:
        return cls(LLMEngine(config))

    # ---- loop ---------------------------------------------------------------------------------
    def _ensure_started(self) -> None:
        if self._task is None or self._task.done():
            self._wakeup = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._run())

    def _kick(self) -> None:
        if self._wakeup is not None:
            self._wakeup.set()

    async def _run(self) -> None:
        assert self._wakeup is not None
        while True:
            self._wakeup.clear()
            if not self.engine.has_work():
                await self._wakeup.wait()
                continue
            try:
                outputs = await asyncio.to_thread(self.engine.step)
            except Exception as err:  # a failing step fails every waiter instead of hanging them
                self._fail_all(err)
                continue
            self._deliver(outputs)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for request_id, queue in list(self._streams.items()):
            snapshot = self.engine.get_request_output(request_id)
            if snapshot is not None:
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
        """Add a request and wait for its final output (across any KEEP pause and weight update)."""
        self._ensure_started()
        request_id = request_id or uuid.uuid4().hex
        future: asyncio.Future[RequestOutput] = asyncio.get_running_loop().create_future()
        self.engine.add_request(request_id, prompt_token_ids, params, cache_salt)
        self._futures[request_id] = future
        self._kick()
        try:
            return await future
        except asyncio.CancelledError:
            self.engine.abort([request_id])
            self._futures.pop(request_id, None)
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
        self.engine.add_request(request_id, prompt_token_ids, params, cache_salt)
        self._streams[request_id] = queue
        self._kick()
        try:
            while True:
                output = await queue.get()
                if isinstance(output, Exception):
                    raise output
                yield output
                if output.finished:
                    return
        finally:
            if self._streams.pop(request_id, None) is not None:
                self.engine.abort([request_id])

    async def abort(self, request_ids: Iterable[str]) -> list[RequestOutput]:
        outputs = await asyncio.to_thread(self.engine.abort, list(request_ids))
        self._kick()
        return outputs

    # ---- lifecycle ----------------------------------------------------------------------------
    async def _call(self, method, *args, **kwargs):
        result = await asyncio.to_thread(method, *args, **kwargs)
        self._kick()
        return result

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
