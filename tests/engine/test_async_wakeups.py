"""The step loop never sleeps through work: control calls wake it from the thread that ran them (so a
caller that gave up still wakes it), a wait pause that something else ended
returns, and health() reports work that no step touches. Each interleaving is forced with the
engine's lock held by the test, not left to timing."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable

import pytest

from inflight.engine import AsyncEngine, EngineConfig, SamplingParams
from inflight.engine import async_engine as async_engine_module

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
ANSWER_S = 3.0  # a request whose engine can run must answer well within this (the backstop is 0.5 s)


async def until(predicate: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.002)


class HeldLock:
    """Hold the engine's lock from another thread (as a long step would) until release()."""

    def __init__(self, engine: AsyncEngine) -> None:
        self._held, self._release = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._hold, args=(engine.engine._lock,), daemon=True)
        self._thread.start()
        assert self._held.wait(10)

    def _hold(self, lock) -> None:
        with lock:
            self._held.set()
            self._release.wait(30)

    def release(self) -> None:
        self._release.set()
        self._thread.join(10)


@pytest.fixture
def make_engine(tiny_model_factory):
    def make(**kwargs) -> AsyncEngine:
        return AsyncEngine.from_config(
            EngineConfig(model=str(tiny_model_factory("qwen2")), block_size=4), **kwargs
        )

    return make


def test_a_resume_whose_caller_gave_up_still_wakes_the_loop(make_engine):
    """The lost wake-up: the resume runs in a worker thread, but the old loop was woken only by the
    coroutine that awaited it. Cancel that coroutine while the call waits for the lock; the call
    still resumes the engine, and the queued request must run without any further event."""

    async def run():
        engine = make_engine()
        await engine.pause("keep")
        task = asyncio.create_task(engine.generate([5, 6, 7], GREEDY, request_id="queued"))
        await until(lambda: "queued" in engine.engine.requests)  # the loop applied it while paused
        await asyncio.sleep(0.05)  # and went idle: nothing can run
        held = HeldLock(engine)
        with pytest.raises(TimeoutError):  # the caller gives up; its worker thread waits for the lock
            await asyncio.wait_for(engine.resume(), 0.05)
        held.release()
        await until(lambda: not engine.engine.is_paused)  # the abandoned call did resume the engine
        output = await asyncio.wait_for(task, ANSWER_S)
        missed = engine.missed_wakeups
        await engine.close()
        return output, missed

    output, missed = asyncio.run(run())
    assert output.finish_reason == "length" and len(output.output_token_ids) == GREEDY.max_tokens
    assert missed == 0  # woken by the call itself, not found later by the backstop


async def _draining_long_request(
    engine: AsyncEngine, draining: Callable[[], bool]
) -> tuple[asyncio.Task, asyncio.Task]:
    """A 900-token request decoding, then a pause('wait') draining it: (request task, pause task).
    `draining` says whether the engine drains (a test counting reads of the state passes its own)."""
    long = SamplingParams(max_tokens=900, temperature=0.0, ignore_eos=True)
    task = asyncio.create_task(engine.generate([5, 6, 7], long, request_id="long"))
    await until(lambda: engine.engine.stats.generated_tokens > 0)  # decoding
    pause = asyncio.create_task(engine.pause("wait"))
    await until(draining)
    return task, pause


def test_a_wait_pause_ended_by_a_resume_returns(make_engine):
    """pause('wait') used to poll until the engine was paused: a resume during the drain left the
    pause call (and its HTTP request) waiting forever."""

    async def run():
        engine = make_engine()
        task, pause = await _draining_long_request(engine, lambda: engine.engine.is_draining)
        await engine.resume()  # ends the drain: the request still has hundreds of tokens to go
        await asyncio.wait_for(pause, ANSWER_S)
        paused = engine.engine.is_paused
        output = await asyncio.wait_for(task, 60)
        await engine.close()
        return paused, output

    paused, output = asyncio.run(run())
    assert not paused and len(output.output_token_ids) == 900


def test_a_wait_pause_sleeps_until_the_drain_ends(make_engine, monkeypatch):
    """pause('wait') used to look at the engine every 5 ms while the drain lasted (issue 18 finding
    7); now the step loop wakes it when the drain ends. With every step held off (the engine's lock
    held by the test), the waiting pause reads the drain state at most once more, however long the
    drain lasts; then the request is aborted, which ends the drain, and the pause returns. The count
    starts once the pause waits and what the last step before the lock queued on the loop has run."""
    from inflight.engine.engine import LLMEngine

    reads: list[str] = []
    draining = LLMEngine.is_draining
    counted = property(lambda self: reads.append(threading.current_thread().name) or draining.fget(self))
    monkeypatch.setattr(LLMEngine, "is_draining", counted)

    async def run():
        engine = make_engine()
        task, pause = await _draining_long_request(engine, lambda: draining.fget(engine.engine))
        held = HeldLock(engine)
        await until(lambda: engine._drain_waiters)  # the pause took its own look and waits
        await asyncio.sleep(0.05)  # the settle a step running when the lock was requested queued
        reads.clear()
        await asyncio.sleep(0.3)  # polling every 5 ms would read it ~60 times in this window
        on_loop = [r for r in reads if r == threading.current_thread().name]
        held.release()
        assert not pause.done()
        await engine.abort(["long"])  # the drain's last request: the drain ends, paused
        await asyncio.wait_for(pause, ANSWER_S)
        output = await asyncio.wait_for(task, ANSWER_S)
        paused = engine.engine.is_paused
        await engine.close()
        return on_loop, paused, output

    on_loop, paused, output = asyncio.run(run())
    assert len(on_loop) <= 1, on_loop
    assert paused and output.finish_reason == "abort"


def test_health_reports_runnable_work_that_no_step_touches(make_engine):
    """A request the engine could run but no step reaches is reported (the step loop is replaced by
    one that never steps, as a lost wake-up would leave it); frozen requests are not stalled."""

    async def run():
        engine = make_engine(stall_s=0.2)
        await engine.pause("keep")
        task = asyncio.create_task(engine.generate([5, 6, 7], GREEDY, request_id="frozen"))
        await until(lambda: "frozen" in engine.engine.requests)
        await asyncio.sleep(0.3)
        frozen = engine.health()
        engine._task.cancel()  # a loop that will never step again
        await asyncio.gather(engine._task, return_exceptions=True)
        engine.engine.resume()  # behind the async engine's back: nothing wakes anything
        await asyncio.sleep(0.3)
        stuck = engine.health()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return frozen, stuck

    frozen, stuck = asyncio.run(run())
    assert not frozen["stalled"] and frozen["waiters"] == 1 and frozen["step_loop"] == "running"
    assert stuck["stalled"] and stuck["step_loop"] == "stopped" and stuck["seconds_since_step"] >= 0.2


def test_the_idle_backstop_finds_work_that_no_wake_up_announced(make_engine, monkeypatch):
    """Even a change made behind the async engine's back (here a direct LLMEngine.resume) is picked
    up within IDLE_RECHECK_S, and counted as a missed wake-up."""
    monkeypatch.setattr(async_engine_module, "IDLE_RECHECK_S", 0.1)

    async def run():
        engine = make_engine()
        await engine.pause("keep")
        task = asyncio.create_task(engine.generate([5, 6, 7], GREEDY, request_id="silent"))
        await until(lambda: "silent" in engine.engine.requests)
        await asyncio.sleep(0.05)
        engine.engine.resume()
        output = await asyncio.wait_for(task, ANSWER_S)
        missed = engine.missed_wakeups
        await engine.close()
        return output, missed

    output, missed = asyncio.run(run())
    assert len(output.output_token_ids) == GREEDY.max_tokens and missed == 1


def test_a_cancel_that_meets_a_wake_up_still_stops_the_idle_loop(tiny_model_factory):
    """asyncio.run() ends by cancelling every task; when a wake-up lands in the same turn as the
    cancel, Python 3.11's wait_for returned the wake-up and dropped the cancel, and the idle loop ran
    on forever (a second asyncio.run over the same engine hung in its shutdown)."""
    engine = AsyncEngine.from_config(EngineConfig(model=str(tiny_model_factory("qwen2")), num_kv_blocks=16))

    async def cancel_with_a_wake_up() -> bool:
        await engine.resume()  # starts the loop; it then idles
        await until(lambda: engine.health()["step_loop"] == "running")
        await asyncio.sleep(0.05)
        engine._wakeup.set()
        engine._task.cancel()
        done, _ = await asyncio.wait({engine._task}, timeout=ANSWER_S)
        return bool(done) and engine._task.cancelled()

    for _ in range(5):  # each round: a fresh event loop around the same engine, as asyncio.run gives
        assert asyncio.run(cancel_with_a_wake_up())
