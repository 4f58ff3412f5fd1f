"""Engine death in training: restart a dead engine process on the current weights, or stop with an
error naming it (`trainer.fully_async.engine_restarts`: how many restarts a run may make).

A restarted engine loads the engines' model again (the run's start weights, at their version) in a
KEEP pause, so it runs nothing yet; then a full weight sync through the run's one transport brings
every engine to the policy's current weights at a new version and resumes them. Not an export of
the current weights: the transports send to every engine at once, the sync needs no disk copy of
the model, and when the death broke a sync the policy's weights are newer than its version (an
export would be labelled wrongly). The live engines receive the same weights again under the new
version, which only costs a sync.

Every weight sync and every restart happen under one lock, with the training step inside it
(`EngineRestarts.lock`), so a restart's sync never reads weights that an optimizer step is
changing and the transport's messages never interleave. A generation group that failed because
its engine died is generated again by the same worker, in the same staleness slot and buffer
ticket, from the same prompt (never trained on: none is lost, none trained twice); `recover` says
when to do that.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from inflight.client.process import EngineProcess

if TYPE_CHECKING:
    from inflight.weight_sync.transport import WeightTransport

log = logging.getLogger(__name__)
KEY = "trainer.fully_async.engine_restarts"
EXIT_WAIT_S = 3.0  # how long a failure may precede its engine's exit status (the pipe closes first)


Report = TypeVar("Report")


class Syncs(Protocol[Report]):
    """What a restart asks of the policy (`inflight.train.runtime.Policy`): a full weight sync."""

    async def sync_weights(self) -> Report: ...


class EngineDiedError(RuntimeError):
    """An engine process died and is not restarted (restarts off or used up)."""


class EngineRestarts:
    """The engine processes of a run (`engines`, index = engine number), the transport their
    receivers use, and the restarts left (`budget`); no engines: nothing to restart (in-process
    or Ray engines), every call passes through."""

    def __init__(
        self, engines: Sequence[EngineProcess], transport: WeightTransport | None, budget: int
    ) -> None:
        self.engines, self.transport, self.budget = list(engines), transport, budget
        self.restarts = 0  # engine processes restarted so far
        self.resubmitted = 0  # generation groups generated again after their engine died
        self.lock = asyncio.Lock()  # bound to the event loop of its first contended use

    @classmethod
    def of(cls, runtime: Any, budget: int) -> EngineRestarts:
        """The restarts of a runtime (`LocalRuntime.engine_procs` and its transport); a runtime
        without engine processes has nothing to restart, and refuses restarts asked of it."""
        if budget > 0 and not hasattr(runtime, "engine_procs"):
            raise ValueError(
                f"{KEY}={budget}: restarting dead engines is implemented for the engine processes "
                f"that `inflight train` starts, not yet for {type(runtime).__name__}'s (Ray actors): "
                f"set {KEY}=0"
            )
        return cls(getattr(runtime, "engine_procs", []), getattr(runtime, "transport", None), budget)

    async def sync(self, policy: Syncs[Report]) -> Report:
        """`policy.sync_weights()` (call with `lock` held); a sync that an engine's death broke is
        done again after the restart."""
        try:
            return await policy.sync_weights()
        except Exception as err:
            dead = await self._dead_after(err)
            if not dead:
                raise
            return await self._restart(dead, policy, err)

    async def recover(self, err: BaseException, policy: Syncs[Any], since: int) -> bool:
        """After `err` in generation: True when the engines are running again, since the call
        that failed began (`since`: `restarts` then), so it should be made again; False when no
        engine died (`err` is the caller's own). Raises `EngineDiedError` when a dead engine is not
        restarted."""
        if not self.engines or isinstance(err, asyncio.CancelledError):
            return False
        await self._dead_after(err, since)
        async with self.lock:
            dead = self.dead()  # another worker may have restarted them meanwhile
            if dead:
                await self._restart(dead, policy, err)
        if dead or self.restarts > since:
            self.resubmitted += 1
            return True
        return False

    def dead(self) -> list[tuple[int, EngineProcess]]:
        """The engines whose process has exited, with their index."""
        return [(i, e) for i, e in enumerate(self.engines) if not e.alive]

    async def _dead_after(
        self, err: BaseException, since: int | None = None
    ) -> list[tuple[int, EngineProcess]]:
        """The dead engines, giving an engine whose pipe or group just closed a moment to report its
        exit (any error may be the first sign: the gloo group's, the pipe's, the transport's); not
        waiting once a restart happened after `since`."""
        deadline = time.monotonic() + (EXIT_WAIT_S if self.engines else 0.0)
        while (
            not (dead := self.dead())
            and time.monotonic() < deadline
            and (since is None or self.restarts == since)
        ):
            await asyncio.sleep(0.05)
        return dead

    async def _restart(self, dead: list[tuple[int, EngineProcess]], policy: Syncs[Report],
                       err: BaseException) -> Report:
        """Restart the dead engines (lock held) and sync every engine to the current weights;
        again while engines die during it and restarts are left."""
        while True:
            names = ", ".join(e.describe() for _, e in dead)
            if self.restarts + len(dead) > self.budget:
                used = (
                    f"{self.restarts} of {self.budget} restarts used" if self.budget else "restarts are off"
                )
                raise EngineDiedError(f"engine process {names} died ({used}: set {KEY} to restart dead "
                                      f"engines); last error: {type(err).__name__}: {err}") from err
            for _, engine in dead:
                self.restarts += 1
                log.warning("engine process %s died; restarting it (restart %d of %d) on the current weights "
                            "and generating its groups again", engine.describe(), self.restarts, self.budget)
            if self.transport is not None and hasattr(self.transport, "readmit"):
                self.transport.readmit([i + 1 for i, _ in dead])  # receiver ranks are 1-based
            await asyncio.gather(*(asyncio.to_thread(e.restart) for _, e in dead))
            try:
                return await policy.sync_weights()
            except Exception as again:
                dead, err = await self._dead_after(again), again
                if not dead:
                    raise

    def metrics(self) -> dict[str, float]:
        """`engine/restarts` and `engine/resubmitted_groups` so far (the step's metrics)."""
        return {"engine/restarts": float(self.restarts), "engine/resubmitted_groups": float(self.resubmitted)}

