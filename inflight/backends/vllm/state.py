"""The shim's lifecycle over vLLM: our pause and update states, the two pools' awake flags, the
weight version and the KV-epoch backstop, and the one rule that derives vLLM's scheduler state
from them (`Lifecycle.settle`).

vLLM's scheduler runs exactly when ours would (`can_run`, as `EngineStatus.can_run`): not paused,
no update open or left invalid, both pools awake. Whenever that is false the scheduler is paused in
vLLM's keep mode with `clear_cache=False` (a keep that keeps: `clear_cache=True` would preempt the
frozen requests); whenever it turns true again the scheduler resumes, after the backstop: if the
KV was declared discarded (`sleep(offload_kv=False)`) since the requests froze, every running and
frozen request is reset first (`reset_prefix_cache(reset_running_requests=True)`), so none ever
attends to KV that our contract says is gone. vLLM has no such check of its own.

Memory: where vLLM runs with sleep mode (`--enable-sleep-mode`, CUDA only: `frees_memory`), our
`sleep` is vLLM's sleep level 1 (weights to host memory, KV cache freed; vLLM resets the requests
that held it first) and `wake_up` is vLLM's `wake_up` of the same pools: the weights at once (an
update reloads into them), the KV cache only when the scheduler is about to run again (vLLM resumes
its scheduler itself once every pool is awake, so an earlier KV wake would let requests run while
ours are still paused). On CPU vLLM has no sleep mode: sleep frees nothing and only the flags move.

Every transition runs under one asyncio lock; `status()` reads without it.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("inflight.backends.vllm")

RUNNING, DRAINING, PAUSED = "running", "draining", "paused"
NONE, OPEN, INVALID = "none", "open", "invalid"


@dataclass
class Stats:
    """Counters of the shim (the names of the native engine's `EngineStats` where they mean the same)."""

    resets: int = 0  # requests reset by reset_prefix_cache(reset_running_requests=True)
    kv_invalidated_resets: int = 0  # requests reset by the backstop (KV declared discarded)
    weight_updates: int = 0
    failed_weight_updates: int = 0
    aborted_weight_updates: int = 0
    expired_weight_updates: int = 0  # open updates abandoned by the lease (weight_update_timeout_s)
    restored_weights: int = 0  # reloads of the last complete weights after a failed reload
    aborted_requests: int = 0


@dataclass
class Lifecycle:
    """Our engine state over one vLLM `AsyncLLM` (`engine`)."""

    engine: Any
    weight_version: int = 0
    pause: str = RUNNING
    pause_mode: str | None = None
    update: str = NONE
    can_roll_back: bool = True  # abort would leave the complete weights of weight_version
    weights_awake: bool = True
    kv_cache_awake: bool = True
    kv_discarded: bool = False  # the KV was declared discarded; reset the frozen requests before they run
    engine_paused: bool = False  # vLLM's scheduler is paused by us
    live: dict[str, Any] = field(default_factory=dict)  # token-route request id -> generate.Live
    stats: Stats = field(default_factory=Stats)
    weight_update_timeout_s: float | None = 300.0  # the lease of an open update (None: none)
    update_touched: float = 0.0  # time.monotonic() of the open update's last begin or chunk
    drain: asyncio.Future | None = None  # vLLM's pause(wait) while our pause is DRAINING
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    running: asyncio.Event = field(default_factory=asyncio.Event)  # set while can_run (new requests go in)
    frees_memory: bool = False  # vLLM runs with sleep mode (CUDA): sleep and wake_up move memory
    asleep: set[str] = field(default_factory=set)  # the pools vLLM holds asleep ("weights", "kv_cache")

    def __post_init__(self) -> None:
        self.running.set()

    @property
    def can_run(self) -> bool:
        return (self.pause != PAUSED and self.update == NONE and self.weights_awake
                and self.kv_cache_awake)

    async def abort_update(self) -> bool:
        """Abandon the update (call under the lock): True when the complete weights of
        weight_version are what vLLM holds (nothing staged reached it, or the last reload undid it)."""
        restored = self.update == NONE or self.can_roll_back
        if self.update != NONE:
            self.update = NONE if restored else INVALID
            self.stats.aborted_weight_updates += 1
        await self.settle()
        return restored

    def update_expired(self, now: float) -> bool:
        """An open update has received nothing (begin or a chunk) for weight_update_timeout_s."""
        timeout = self.weight_update_timeout_s
        return self.update == OPEN and timeout is not None and now - self.update_touched >= timeout

    async def settle(self) -> None:
        """Pause or resume vLLM's scheduler to match `can_run` (call under the lock)."""
        if self.can_run and self.engine_paused:
            if self.kv_discarded:
                await self.reset_running("kv_invalidated_resets")
                self.kv_discarded = False
            await self.wake_engine(["kv_cache"])  # the last pool: vLLM resumes its scheduler itself
            await self.engine.resume_generation()
            self.engine_paused = False
        elif not self.can_run and not self.engine_paused:
            await self.engine.pause_generation(mode="keep", clear_cache=False)
            self.engine_paused = True
        if self.can_run:
            self.running.set()
        else:
            self.running.clear()

    async def sleep_engine(self) -> None:
        """vLLM's sleep level 1 where it frees memory (call under the lock, scheduler paused): the
        weights go to host memory and the KV cache is freed. Once per sleep: vLLM's sleep acts on
        every pool, so while one is still asleep nothing more is freed."""
        if self.frees_memory and not self.asleep:
            await self.engine.sleep(level=1, mode="keep")
            self.asleep = {"weights", "kv_cache"}

    async def wake_engine(self, tags: list[str]) -> None:
        """vLLM's wake_up of those of `tags` that it holds asleep (call under the lock)."""
        waking = [t for t in tags if t in self.asleep]
        if waking:
            await self.engine.wake_up(tags=waking)
            self.asleep -= set(waking)

    async def reset_running(self, counter: str) -> bool:
        """reset_prefix_cache(reset_running_requests=True): every running and frozen request drops
        its blocks and re-reads its tokens so far; counted (requests this server knows of) in `counter`."""
        ok = bool(await self.engine.reset_prefix_cache(reset_running_requests=True))
        setattr(self.stats, counter, getattr(self.stats, counter) + len(self.live))
        return ok

    async def pause_engine(self, mode: str) -> int:
        """Our pause(mode) (call under the lock): returns how many requests an abort ended. `wait`
        only starts the drain: the caller awaits `drained()` without the lock, so that a resume or
        another pause can end the drain (as on the native engine) instead of waiting behind it."""
        self.running.clear()  # what arrives from now on waits for the resume
        await self.end_drain()
        aborted = 0
        if mode == "wait":
            self.pause, self.pause_mode = DRAINING, "wait"
            self.drain = asyncio.ensure_future(self.engine.pause_generation(mode="wait", clear_cache=False))
            return 0
        if mode == "abort":
            aborted = len(self.live)
            await self.engine.pause_generation(mode="abort", clear_cache=False)
            self.stats.aborted_requests += aborted
        else:
            await self.engine.pause_generation(mode="keep", clear_cache=False)
        self.engine_paused = True
        self.pause, self.pause_mode = PAUSED, mode
        return aborted

    async def drained(self) -> None:
        """Wait (without the lock) until the drain a pause(wait) started is over: its requests
        finished (then the engine is paused), or a resume or another pause ended it."""
        drain = self.drain
        if drain is None:
            return
        await asyncio.wait({drain})
        async with self.lock:
            if self.drain is drain and not drain.cancelled():
                drain.result()  # vLLM's error, if the drain failed
                self.drain, self.engine_paused = None, True
                self.pause, self.pause_mode = PAUSED, "wait"

    async def end_drain(self) -> None:
        """End a drain in progress (call under the lock): vLLM leaves its drain pause, and the
        caller sets what comes next (vLLM's own wait resolves whenever its engine next idles)."""
        drain, self.drain = self.drain, None
        if drain is not None and not drain.done():
            drain.cancel()
            await self.engine.resume_generation()

    def status(self) -> dict[str, Any]:
        """The keys of the native `EngineStatus.to_dict()` that have a meaning here (`kv_cache_usage`
        is not known to the shim: None), plus the shim's counters and each live request's progress."""
        num_live = len(self.live)
        frozen = num_live if (self.engine_paused and self.pause != DRAINING) else 0
        return {
            "weight_version": self.weight_version, "pause": self.pause, "pause_mode": self.pause_mode,
            "update": self.update, "can_roll_back": self.can_roll_back, "weights_awake": self.weights_awake,
            "kv_cache_awake": self.kv_cache_awake, "can_run": self.can_run, "num_running": num_live,
            "num_waiting": 0, "num_frozen": frozen, "kv_cache_usage": None,
            "paused": self.pause == PAUSED, "draining": self.pause == DRAINING,
            "has_unfinished": num_live > 0, "backend": "vllm", "kv_discarded": self.kv_discarded,
            "frees_memory": self.frees_memory, "vllm_asleep": sorted(self.asleep),
            "vllm_num_unfinished": self.engine.get_num_unfinished_requests(),  # every route's, in vLLM
            "stats": dict(vars(self.stats)),
            # token-route requests in flight: output tokens this server has received of each so far
            "live_output_tokens": {rid: getattr(lv, "num_outputs", 0) for rid, lv in list(self.live.items())},
        }
