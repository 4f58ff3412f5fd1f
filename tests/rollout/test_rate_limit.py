"""`generator.rate_limit`: episodes started per second (a token bucket, against SkyRL's own
`AsyncRateLimiter`) and in flight at once, on a driven clock (no real waiting); one limiter per config
section, shared by the generators built from it; the generator's episodes go through it."""

from __future__ import annotations

import asyncio
import time
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
from scripted import ScriptedClient, encode
from skyrl_oracle import import_skyrl

from inflight.config import load_config
from inflight.rollout.rate_limit import NO_LIMIT, RateLimiter, limiter_for, shared_limiter
from inflight.rollout.task_generator import TaskGenerator, episode_options
from inflight.tasks.base import Problem, Task
from inflight.testing import LOCAL_CPU
from inflight.testing.tiny_model import make_tokenizer


class Clock:
    """A clock that moves only when someone sleeps on it."""

    def __init__(self) -> None:
        self.now, self.sleeps = 0.0, []

    def __call__(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += max(seconds, 1e-9)  # a real clock moves on past a rounding-error wait
        await asyncio.sleep(0)


def start_times(limiter: RateLimiter, clock: Clock, n: int) -> list[float]:
    async def one(out: list[float]) -> None:
        async with limiter:
            out.append(clock())

    async def main() -> list[float]:
        out: list[float] = []
        await asyncio.gather(*(one(out) for _ in range(n)))
        return out

    return asyncio.run(main())


@contextmanager
def skyrl_limiter(rate: float, clock: Clock):
    """SkyRL's own `AsyncRateLimiter` (the oracle), on the driven clock while in use."""
    module = import_skyrl("skyrl.train.utils.rate_limiter")
    module.time = SimpleNamespace(monotonic=clock)
    module.asyncio = SimpleNamespace(sleep=clock.sleep, Lock=asyncio.Lock, Semaphore=asyncio.Semaphore)
    try:
        yield module.AsyncRateLimiter(rate=rate)
    finally:
        module.time, module.asyncio = time, asyncio


@pytest.mark.parametrize("rate", [1.0, 1.5, 2.0, 3.7])
def test_starts_per_second_are_skyrls_token_bucket(rate):
    clock, oracle_clock = Clock(), Clock()
    with skyrl_limiter(rate, oracle_clock) as oracle:
        want = start_times(oracle, oracle_clock, 12)
    assert start_times(RateLimiter(rate, clock=clock, sleep=clock.sleep), clock, 12) == pytest.approx(want)
    assert want[: int(rate)] == [0.0] * int(rate) and want[-1] > 0  # a full bucket, then the rate


def test_rates_below_one_per_second_work_here():
    clock = Clock()
    # SkyRL refuses them
    with pytest.raises(ValueError, match="Rate must be >= 1.0"), skyrl_limiter(0.5, clock):
        pass
    limiter = RateLimiter(0.5, clock=clock, sleep=clock.sleep)
    assert start_times(limiter, clock, 4) == pytest.approx([0, 2, 4, 6])  # one start, then every 2 s


def test_max_concurrency_bounds_episodes_in_flight():
    limiter, peak = RateLimiter(None, 3), []

    async def one() -> None:
        async with limiter:
            peak.append(limiter.running)
            await asyncio.sleep(0)
            await asyncio.sleep(0)

    async def main() -> None:
        await asyncio.gather(*(one() for _ in range(10)))

    asyncio.run(main())
    assert max(peak) == 3 and len(peak) == 10 and limiter.running == 0


def test_config_makes_one_shared_limiter_per_section():
    cfg = load_config(
        None,
        [
            *LOCAL_CPU, "generator.rate_limit.enabled=true", "generator.rate_limit.trajectories_per_second=4",
            "generator.rate_limit.max_concurrency=2",
        ],
    )
    first, again = (
        episode_options(cfg)["rate_limiter"],
        episode_options(cfg, cfg.generator.eval_sampling_params),
    )
    # training and evaluation share it
    assert isinstance(first, RateLimiter) and again["rate_limiter"] is first
    assert (first.per_second, first.max_concurrency) == (4.0, 2)
    off = load_config(None, [*LOCAL_CPU, "generator.rate_limit.max_concurrency=2"])  # enabled=false
    assert shared_limiter(off.generator.rate_limit) is NO_LIMIT
    on_without_limits = load_config(None, [*LOCAL_CPU, "generator.rate_limit.enabled=true"])
    assert limiter_for(on_without_limits.generator.rate_limit) is NO_LIMIT
    with pytest.raises(ValueError, match="max_concurrency=0 must be >= 1"):
        RateLimiter(None, 0)


class OneTurnTask(Task):
    def train_problems(self):
        return [Problem("p", "hi", "x")]

    def eval_problems(self):
        return self.train_problems()

    def reward(self, problem, response):
        return 1.0


class CountingClient(ScriptedClient):
    """Records how many requests are in flight at once."""

    def __init__(self, turns) -> None:
        super().__init__(turns)
        self.active, self.peak = 0, 0

    async def generate(self, prompt_token_ids, params=None, **kwargs):
        self.active += 1
        self.peak = max(self.peak, self.active)
        await asyncio.sleep(0)
        try:
            return await super().generate(prompt_token_ids, params, **kwargs)
        finally:
            self.active -= 1


def test_the_generator_plays_its_episodes_within_the_limits():
    tok = make_tokenizer()
    task = OneTurnTask(tok)
    turns = [(encode(tok, "ok") + [tok.eos_token_id], "stop")] * 8
    free, limited = CountingClient(turns), CountingClient(turns)
    asyncio.run(TaskGenerator(free, task, n=8)(task.train_problems()[0]))
    group = asyncio.run(
        TaskGenerator(limited, task, n=8, rate_limiter=RateLimiter(None, 2))(task.train_problems()[0])
    )
    assert free.peak == 8 and limited.peak == 2 and group.rewards == [1.0] * 8
