"""Staleness control for the fully-async trainer: the staleness manager, the output buffer and the
data loader that records which prompts were consumed.

Capacity law (AReaL; SkyRL's fully-async trainer): with `global_step` the 1-based step the trainer
is about to take, groups may be started only while

    accepted + running <= (max_staleness_steps + global_step) * mini_batch_size

where `accepted` counts every group that ever entered the buffer (trained or waiting) and
`running` the groups being generated. Groups are trained in the order they started (the output
buffer waits for a straggler instead of overtaking it), `mini_batch_size` per step, so a group
started while the trainer was before step g is trained at step g + max_staleness_steps at the
latest: its tokens are at most `max_staleness_steps` weight versions older than the policy that
trains on them. (Trained in acceptance order instead, a straggler could be overtaken without
bound.) A filtered (rejected) group frees its slot without being accepted, so filtering can never
deadlock the loop. `max_concurrency` (the number of generation workers) caps `running` as well.

Everything here runs on one asyncio event loop; no locks are needed.
"""

from __future__ import annotations

import asyncio
import random
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class StalenessManager:
    """Admission control for generation groups (see the module docstring for the law)."""

    def __init__(self, max_staleness_steps: int, mini_batch_size: int, max_concurrency: int | None = None,
                 global_step: int = 1, accepted: int = 0) -> None:
        if max_staleness_steps < 0 or mini_batch_size < 1:
            raise ValueError("max_staleness_steps must be >= 0 and mini_batch_size >= 1")
        self.max_staleness_steps, self.mini_batch_size = max_staleness_steps, mini_batch_size
        self.max_concurrency, self.global_step, self.accepted = max_concurrency, global_step, accepted
        self.running = 0
        self.rejected = 0
        self._changed = asyncio.Event()  # bound to the event loop of its first wait
        self.on_change: Callable[[], None] | None = None  # called after every change (the trainer's lending)

    @property
    def limit(self) -> int:
        """The most groups that may have been accepted or be running now."""
        return (self.max_staleness_steps + self.global_step) * self.mini_batch_size

    def capacity(self) -> int:
        """How many more groups may start now."""
        free = self.limit - (self.accepted + self.running)
        if self.max_concurrency is not None:
            free = min(free, self.max_concurrency - self.running)
        return max(0, free)

    @property
    def generation_ahead(self) -> bool:
        """Bounded staleness reached and nothing generating: no group may start until the trainer
        takes a step, so the engines are idle (the fully-async trainer lends it their cores)."""
        return self.running == 0 and self.capacity() == 0

    def try_start(self) -> bool:
        """Claim a slot if there is one (running += 1)."""
        if self.capacity() <= 0:
            return False
        self.running += 1
        self._changes()
        return True

    async def start(self) -> None:
        """Wait for a slot and claim it."""
        while not self.try_start():
            self._changed.clear()
            await self._changed.wait()

    def accept(self) -> None:
        """A running group finished and entered the buffer."""
        self._finish()
        self.accepted += 1
        self._changes()

    def reject(self) -> None:
        """A running group finished and was filtered out (or never started: no prompt was left)."""
        self._finish()
        self.rejected += 1
        self._changes()

    def cancel(self) -> None:
        """A claimed slot was given back without generating (no prompt left, shutdown)."""
        self._finish()
        self._changes()

    def step_done(self) -> None:
        """The trainer finished step `global_step`; the window moves by one mini-batch."""
        self.global_step += 1
        self._changed.set()
        self._changes()

    def _finish(self) -> None:
        """One running group less; the waiting starters look again (the loop runs them later, after
        the caller's own bookkeeping)."""
        if self.running <= 0:
            raise RuntimeError("no running group to finish")
        self.running -= 1
        self._changed.set()

    def _changes(self) -> None:
        if self.on_change is not None:
            self.on_change()

    def state(self) -> dict[str, int]:
        return {"global_step": self.global_step, "accepted": self.accepted, "running": self.running,
                "rejected": self.rejected, "limit": self.limit, "capacity": self.capacity()}


class OutputBuffer(Generic[T]):
    """Finished groups, handed to the trainer in the order they were *started*.

    Each group gets a sequence number when it starts (`ticket()`); it is `put` under that number
    when accepted or `skip`ped when filtered out or never generated. `get(n)` returns the next `n`
    groups of the contiguous prefix of finished sequence numbers, waiting for a straggler rather
    than overtaking it: that is what makes the staleness bound hard (a group started while the
    trainer was before step g is among the first (max_staleness_steps + g) * mini_batch_size
    accepted in start order, so it is trained at step g + max_staleness_steps at the latest).
    """

    def __init__(self) -> None:
        self._items: dict[int, T] = {}
        self._skipped: set[int] = set()
        self._ready: deque[T] = deque()  # the contiguous prefix, in start order
        self._next = 0  # first sequence number not yet moved to `_ready`
        self._issued = 0
        self._event = asyncio.Event()  # bound to the event loop of its first wait
        self.closed = False

    def __len__(self) -> int:
        return len(self._ready) + len(self._items)

    def ticket(self) -> int:
        """The sequence number of a group that starts now."""
        self._issued += 1
        return self._issued - 1

    def put(self, item: T, seq: int | None = None) -> None:
        """A finished group (`seq`: its ticket; None takes a ticket now, for in-order producers)."""
        self._items[self.ticket() if seq is None else seq] = item
        self._advance()

    def skip(self, seq: int) -> None:
        """The group of ticket `seq` will never come (filtered out, or no prompt was left)."""
        self._skipped.add(seq)
        self._advance()

    def _advance(self) -> None:
        while True:
            if self._next in self._items:
                self._ready.append(self._items.pop(self._next))
            elif self._next in self._skipped:
                self._skipped.remove(self._next)
            else:
                break
            self._next += 1
        self._event.set()

    def close(self) -> None:
        """No more groups will come: a waiting `get` returns what is ready."""
        self.closed = True
        self._event.set()

    @property
    def ready(self) -> int:
        """Groups the trainer could take now."""
        return len(self._ready)

    async def get(self, n: int) -> list[T]:
        """The next `n` groups in start order; fewer (possibly none) only once closed."""
        while len(self._ready) < n and not self.closed:
            self._event.clear()
            await self._event.wait()
        return [self._ready.popleft() for _ in range(min(n, len(self._ready)))]


@dataclass
class PromptRef(Generic[T]):
    """A prompt handed out by the loader: its epoch, its index in the dataset, the item, and its
    position in the epoch's order."""

    epoch: int
    index: int
    item: T
    position: int


@dataclass
class _EpochState:
    watermark: int = 0  # every position < watermark of this epoch's order is consumed
    above: set[int] = field(default_factory=set)  # consumed positions >= watermark


class AsyncDataLoader(Generic[T]):
    """Hands out dataset items epoch by epoch (a seeded shuffle per epoch) and records which were
    consumed (trained on, or filtered out). `state()` / `load_state()` carry the record through a
    checkpoint: after a resume, items handed out but never consumed are handed out again, and
    consumed ones never are, so a killed and resumed run uses every prompt exactly once per epoch.
    """

    def __init__(self, items: Sequence[T], epochs: int = 1, seed: int = 0) -> None:
        if not items:
            raise ValueError("the dataset is empty")
        self.items, self.epochs, self.seed = items, epochs, seed
        self._consumed: dict[int, _EpochState] = {}
        self._cursor = (0, 0)  # (epoch, position) of the next hand-out
        self._orders: dict[int, list[int]] = {}

    def order(self, epoch: int) -> list[int]:
        """Dataset indices in the order epoch `epoch` visits them."""
        if epoch not in self._orders:
            order = list(range(len(self.items)))
            random.Random(f"{self.seed}-{epoch}").shuffle(order)
            self._orders = {epoch: order}  # only `next` reads an order, epoch after epoch
        return self._orders[epoch]

    def next(self) -> PromptRef[T] | None:
        """The next item not yet consumed, or None when every epoch is done."""
        epoch, pos = self._cursor
        while epoch < self.epochs:
            state = self._consumed.get(epoch, _EpochState())
            order = self.order(epoch)
            while pos < len(order):
                if pos >= state.watermark and pos not in state.above:
                    self._cursor = (epoch, pos + 1)
                    return PromptRef(epoch, order[pos], self.items[order[pos]], pos)
                pos += 1
            epoch, pos = epoch + 1, 0
        self._cursor = (epoch, 0)
        return None

    @property
    def exhausted(self) -> bool:
        return self._cursor[0] >= self.epochs

    def mark_consumed(self, ref: PromptRef[Any]) -> None:
        state = self._consumed.setdefault(ref.epoch, _EpochState())
        if ref.position < state.watermark or ref.position in state.above:
            raise RuntimeError(f"prompt {ref.index} of epoch {ref.epoch} was consumed twice")
        state.above.add(ref.position)
        while state.watermark in state.above:
            state.above.remove(state.watermark)
            state.watermark += 1

    def num_consumed(self, epoch: int) -> int:
        state = self._consumed.get(epoch)
        return 0 if state is None else state.watermark + len(state.above)

    def state(self) -> dict[str, Any]:
        """JSON-able record of consumption (hand-outs in flight are not part of it)."""
        consumed = {
            str(e): {"watermark": s.watermark, "above": sorted(s.above)} for e, s in self._consumed.items()
        }
        return {"seed": self.seed, "num_items": len(self.items), "consumed": consumed}

    def load_state(self, state: dict[str, Any]) -> None:
        if state.get("num_items") != len(self.items) or state.get("seed") != self.seed:
            raise ValueError("the checkpoint's data record is for another dataset or seed")
        self._consumed = {
            int(e): _EpochState(s["watermark"], set(s["above"])) for e, s in state["consumed"].items()
        }
        first = min(
            (e for e in range(self.epochs) if self.num_consumed(e) < len(self.items)), default=self.epochs
        )
        self._cursor = (
            first,
            self._consumed.get(first, _EpochState()).watermark if first < self.epochs else 0,
        )
