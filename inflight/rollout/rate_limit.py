"""A limit on the episodes a generator plays: started per second and in flight at once
(`generator.rate_limit`, the key of SkyRL's agent examples, with the meaning of SkyRL's
`skyrl/train/utils/rate_limiter.py`).

The rate is a token bucket: it holds at most `trajectories_per_second` tokens (at least 1, so rates
below one episode per second work too), starts full, refills at that rate, and each episode takes
one token before it starts. The concurrency limit lets at most `max_concurrency` episodes run at
once; one that ends frees its slot. An episode waits for its token first, then for a slot. Every
generator made from one config section shares one limiter (`shared_limiter`), so evaluation that
runs beside training counts against the same limits. The clock and the sleep are parameters so
tests can drive them.
"""

from __future__ import annotations

import asyncio
import time
import weakref
from collections.abc import Awaitable, Callable
from typing import Any


class RateLimiter:
    """At most `per_second` episode starts per second and `max_concurrency` episodes at once (None:
    no such limit). `async with limiter:` around an episode."""

    def __init__(self, per_second: float | None = None, max_concurrency: int | None = None, *,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep) -> None:
        if per_second is not None and per_second <= 0:
            raise ValueError(f"generator.rate_limit.trajectories_per_second={per_second} must be > 0")
        if max_concurrency is not None and max_concurrency < 1:
            raise ValueError(f"generator.rate_limit.max_concurrency={max_concurrency} must be >= 1")
        self.per_second, self.max_concurrency = per_second, max_concurrency
        self.clock, self.sleep = clock, sleep
        self.capacity = max(1.0, per_second or 1.0)
        self.tokens, self.refilled = self.capacity, clock()
        self.running = 0
        # asyncio's primitives belong to one event loop: one set per loop (a run has one)
        self._loops: weakref.WeakKeyDictionary[
            asyncio.AbstractEventLoop, tuple[asyncio.Lock, asyncio.Semaphore]
        ] = weakref.WeakKeyDictionary()

    def _primitives(self) -> tuple[asyncio.Lock, asyncio.Semaphore]:
        loop = asyncio.get_running_loop()
        if loop not in self._loops:
            self._loops[loop] = (asyncio.Lock(), asyncio.Semaphore(self.max_concurrency or 1))
        return self._loops[loop]

    async def __aenter__(self) -> RateLimiter:
        lock, slots = self._primitives()
        if self.per_second is not None:
            await self._take_token(lock)
        if self.max_concurrency is not None:
            await slots.acquire()
        self.running += 1
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self.running -= 1
        if self.max_concurrency is not None:
            self._primitives()[1].release()

    async def _take_token(self, lock: asyncio.Lock) -> None:
        async with lock:  # one waiter at a time: starts keep their order
            while True:
                now = self.clock()
                self.tokens = min(self.capacity, self.tokens + (now - self.refilled) * self.per_second)
                self.refilled = now
                if self.tokens >= 1.0 - 1e-9:  # a refill that lands on 1 up to rounding counts
                    self.tokens = max(0.0, self.tokens - 1.0)
                    return
                await self.sleep((1.0 - self.tokens) / self.per_second)


class NoLimit:
    """No limit (`generator.rate_limit.enabled=false`, or neither limit set)."""

    async def __aenter__(self) -> NoLimit:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        return None


NO_LIMIT = NoLimit()
_SHARED: dict[int, tuple[weakref.ref, RateLimiter | NoLimit]] = {}


def limiter_for(section: Any) -> RateLimiter | NoLimit:
    """A new limiter for a `generator.rate_limit` section (`enabled`, `trajectories_per_second`,
    `max_concurrency`)."""
    per_second, concurrency = section.trajectories_per_second, section.max_concurrency
    if not section.enabled or (per_second is None and concurrency is None):
        return NO_LIMIT
    return RateLimiter(per_second, concurrency)


def shared_limiter(section: Any) -> RateLimiter | NoLimit:
    """The one limiter of this config section object (made on first use): every generator built
    from the same config shares it."""
    entry = _SHARED.get(id(section))
    if entry is not None and entry[0]() is section:
        return entry[1]
    key, limiter = id(section), limiter_for(section)
    _SHARED[key] = (weakref.ref(section, lambda _: _SHARED.pop(key, None)), limiter)
    return limiter
