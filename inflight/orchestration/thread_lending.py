"""The torch threads of the policy's training step, and the engines' threads lent to it.

A CPU run splits the machine between the trainer (`job.threads`) and its engines
(`job.engine_threads` each). When only one side computes, the other's cores would sit idle, so
(`job.lend_threads=true`; null: from `LEND_MIN_PARAMETERS` on) the side that runs takes them, both
ways: the synchronous trainer generates and trains in turns, so its engines start with the
trainer's threads added to theirs and its steps run with the engines' added to the trainer's
(`lent` for good); the fully-async trainer's steps take the engines' threads only while generation
is ahead (bounded staleness reached and nothing generating: `StalenessManager.generation_ahead`)
and give them back as soon as a group may start again, within the step; conversely its engines
take the trainer's threads (shared among them) only while the trainer waits for groups, with
nothing to train (`ThreadLending.waiting`), and give them back at their next step once a training
step starts. An engine reads the threads lent to it at each of its steps, in the thread that steps
it, through `inflight.engine.step_threads` (a word in shared memory: engines in child processes
read it too) and counts its steps with and without them (the `threads/engine_lent_fraction` metric).

torch's thread count is per thread (each thread's OpenMP setting), so it is changed in the thread
that computes: `ThreadLending.run` sets it before the step and, when the step follows the lending,
again at each module's forward and at each gradient the backward computes for a module's input
(a global module forward pre-hook, registered for the step's length, that does nothing on other
threads). A lending that ends mid-step shrinks the step's next parallel region to the trainer's
own threads; the OpenMP worker it stops using spins for a moment and sleeps (the engine child's
`GOMP_SPINCOUNT`, `inflight.client.process`, keeps that moment short on the engine's side).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn.modules.module import register_module_forward_pre_hook

from inflight.config import ConfigError, Violation
from inflight.engine.step_threads import EngineThreads, SharedThreads
from inflight.orchestration.engine_memory import parameter_count


class ThreadLending:
    """The training step's torch threads: `base` while the engines compute beside it, `base +
    lendable` while `lent`. `lend()` may be called from any thread; the training thread applies it
    (`run`). `seen` holds every thread count a step computed with, in order of first use (what a
    test or a bench reads). With `engine_lendable` threads for each of `engines` engines, the
    engines take them while the trainer is `waiting()` (`engine_threads` gives each its handle)."""

    def __init__(self, base: int, lendable: int = 0, engine_lendable: int = 0, engines: int = 1) -> None:
        if base < 1 or lendable < 0 or engine_lendable < 0:
            raise ValueError(f"threads {base} (>= 1), lendable {lendable} and engine_lendable "
                             f"{engine_lendable} (>= 0) are not a thread split")
        self.base, self.lendable, self.engine_lendable = base, lendable, engine_lendable
        self.lent = False
        self.seen: list[int] = []
        self.shared = SharedThreads(engines) if engine_lendable else None
        self._counted = (0, 0)  # the engines' steps (own threads, lent) at the last `metrics()`

    @property
    def wanted(self) -> int:
        """The threads the step should compute with now."""
        return self.base + (self.lendable if self.lent else 0)

    def lend(self, lent: bool) -> None:
        """Give the step the engines' threads (`lent`) or take them back, from its next module or
        gradient on."""
        self.lent = lent

    def apply(self) -> int:
        """On the computing thread: set its torch threads to `wanted` if they differ; returns them."""
        wanted = self.wanted
        if torch.get_num_threads() != wanted:
            torch.set_num_threads(wanted)
        if wanted not in self.seen:
            self.seen.append(wanted)
        return wanted

    def engine_threads(self, index: int, base: int) -> int | EngineThreads:
        """Engine `index`'s torch threads: its own `base`, plus the trainer's while it waits when
        the engines take them."""
        return base if self.shared is None else EngineThreads(self.shared, index, base)

    @contextmanager
    def waiting(self) -> Iterator[None]:
        """The trainer waits for data, its threads idle: the engines take them from their next
        step on, and give them back at their next step after this ends."""
        if self.shared is None:
            yield
            return
        self.shared.lend(self.engine_lendable)
        try:
            yield
        finally:
            self.shared.lend(0)

    def metrics(self) -> dict[str, float]:
        """The engines' steps since the last call, and the fraction that ran with the trainer's
        threads (none when the engines take none)."""
        if self.shared is None:
            return {}
        own, lent = self.shared.steps()
        steps, lent_steps = own + lent - sum(self._counted), lent - self._counted[1]
        self._counted = (own, lent)
        return {"threads/engine_steps": float(steps),
                "threads/engine_lent_fraction": lent_steps / steps if steps else 0.0}

    def close(self) -> None:
        """Release what the engines read their lent threads from."""
        if self.shared is not None:
            self.shared.close()

    def run(self, fn: Callable[..., Any], *args: Any, follow: bool = False) -> Any:
        """Call `fn(*args)` on this thread with the threads lent now; with `follow` (and threads to
        lend), lendings that start or end during the call take effect within it."""
        self.apply()
        if not (follow and self.lendable):
            return fn(*args)
        with self._following():
            return fn(*args)

    @contextmanager
    def _following(self) -> Iterator[None]:
        thread = threading.get_ident()
        apply = self.apply

        def on_gradient(_grad: torch.Tensor) -> None:
            apply()

        def before_forward(_module: torch.nn.Module, args: tuple[Any, ...]) -> None:
            if threading.get_ident() != thread:
                return
            apply()
            first = args[0] if args else None
            if isinstance(first, torch.Tensor) and first.requires_grad:
                first.register_hook(on_gradient)  # the backward reaches this module's input

        handle = register_module_forward_pre_hook(before_forward)
        try:
            yield
        finally:
            handle.remove()


@dataclass(frozen=True)
class ThreadSplit:
    """How a run's threads are split: the trainer's own (`trainer`), each engine's at start-up
    (`engine`), the engines' threads the training step may borrow (`lendable`), whether the
    steps follow a lending that changes while they run (`follow`) or hold it for good, and the
    number of engines that lend (`engines`)."""

    trainer: int
    engine: int
    lendable: int = 0
    follow: bool = False
    engines: int = 1

    def lending(self) -> ThreadLending:
        """The training step's threads under this split (lent for good unless the steps follow);
        when they follow, the engines take the trainer's threads (shared among them) while it waits."""
        engine_lendable = self.trainer // self.engines if self.follow and self.lendable else 0
        lending = ThreadLending(self.trainer, self.lendable, engine_lendable, self.engines)
        lending.lend(self.lendable > 0 and not self.follow)
        return lending


LEND_MIN_PARAMETERS = 10_000_000
"""`job.lend_threads=null` lends from this many policy parameters on: measured, a second OpenMP
thread slows both phases of the 0.8M demo model and pays on 41M (docs/benchmarks.md)."""


def lends(cfg: Any, job: Any, engines_here: bool) -> bool:
    """`job.lend_threads`, null resolved: lend where the engines' threads are the run's to lend and the
    policy has at least `LEND_MIN_PARAMETERS` parameters."""
    if job.lend_threads is not None:
        return job.lend_threads
    if not engines_here or job.ray or job.ray_address:
        return False
    count = parameter_count(cfg.trainer.policy.model.path)
    return count is not None and count >= LEND_MIN_PARAMETERS


def thread_split(cfg: Any, job: Any, engines_here: bool) -> ThreadSplit:
    """The split of `job.threads` and `job.engine_threads` for a run of `cfg` (see the module
    docstring); `engines_here`: the engines run in this run's own processes (local engine processes
    or in this one), whose threads are the run's to lend."""
    if job.lend_threads and not engines_here:
        raise ConfigError([Violation("job.lend_threads", True, "cannot lend the threads of engines on HTTP "
                                     "servers (vLLM, external_server_urls), whose CPUs are fixed at launch",
                                     "set job.lend_threads=false")])
    if not lends(cfg, job, engines_here):
        return ThreadSplit(job.threads, job.engine_threads)
    engines = cfg.generator.inference_engine.num_engines
    lendable = engines * job.engine_threads
    if cfg.trainer.fully_async.enabled:
        return ThreadSplit(job.threads, job.engine_threads, lendable, follow=True, engines=engines)
    return ThreadSplit(job.threads, job.engine_threads + job.threads // engines, lendable, engines=engines)
