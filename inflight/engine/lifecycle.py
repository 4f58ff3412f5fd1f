"""The engine's lifecycle as two explicit states, and `EngineStatus`, the snapshot that reports them.

A `PauseState` says whether generation runs: RUNNING, DRAINING (a `pause("wait")` lets the requests
that arrived up to its cutoff finish) or PAUSED (by the mode that paused it). An `UpdateState` says
whether the weights are the complete weights of `weight_version`: NONE (they are), OPEN (an update
is loading chunks) or INVALID (asleep, or an update failed), and holds the storage that
`abort_weight_update()` puts back. The engine runs the model only when RUNNING or DRAINING, with
the update state NONE and both memory pools awake (`EngineStatus.can_run`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from inflight.engine.models.common import PartialWeight

PAUSE_MODES = ("abort", "keep", "wait")


class PausePhase(StrEnum):
    RUNNING = "running"
    DRAINING = "draining"  # pause("wait"): requests that arrived before it run to completion
    PAUSED = "paused"


@dataclass(frozen=True)
class PauseState:
    """Replaced whole on every transition, so a reader without the engine's lock sees one state."""

    phase: PausePhase = PausePhase.RUNNING
    mode: str | None = None  # the pause mode that led here; None while running
    cutoff: int | None = None  # DRAINING: the last arrival that is still admitted


class UpdatePhase(StrEnum):
    NONE = "none"  # no update in progress; the weights are complete
    OPEN = "open"  # between begin_weight_update() and finish/abort
    INVALID = "invalid"  # incomplete weights (slept, or an update failed) until a complete update lands


@dataclass(frozen=True)
class UpdateState:
    """Replaced on every phase change; only `loaded` grows in place while the update is open."""

    phase: UpdatePhase = UpdatePhase.NONE
    loaded: set[str] = field(default_factory=set)  # OPEN: parameters loaded since begin
    adapter: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)  # OPEN: weight -> {"A", "B"}
    rollback: dict[str, torch.Tensor] | None = None  # old storage per overwritten parameter, for abort
    intact: bool = True  # OPEN without rollback: the parameters still hold the complete weights
    touched: float = 0.0  # OPEN: time.monotonic() of the last begin or chunk (the lease's start)
    pieces: dict[str, PartialWeight] = field(default_factory=dict)  # OPEN: split weights, some pieces landed

    @classmethod
    def invalid(cls, rollback: dict[str, torch.Tensor] | None = None) -> UpdateState:
        return cls(UpdatePhase.INVALID, rollback=rollback, intact=False)


@dataclass(frozen=True)
class EngineStatus:
    """One snapshot of the engine's state (`LLMEngine.status()`); `to_dict()` is its JSON form."""

    weight_version: int
    pause: PausePhase
    pause_mode: str | None  # the mode of the pause in effect (DRAINING: "wait"); None while running
    update: UpdatePhase
    can_roll_back: bool  # abort_weight_update() would put the pre-update weights back
    weights_awake: bool
    kv_cache_awake: bool
    can_run: bool  # step() runs the model whenever a request is unfinished (and admissible)
    num_running: int  # requests holding a running slot (frozen ones included)
    num_waiting: int
    num_frozen: int  # running requests that hold their blocks but do not advance (can_run is False)
    kv_cache_usage: float  # fraction of KV blocks in use

    @property
    def paused(self) -> bool:
        return self.pause is PausePhase.PAUSED

    @property
    def draining(self) -> bool:
        return self.pause is PausePhase.DRAINING

    @property
    def has_unfinished(self) -> bool:
        return self.num_running + self.num_waiting > 0

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready values (the phases are str enums), plus the derived `paused`, `draining` and
        `has_unfinished`."""
        return {**asdict(self), "paused": self.paused, "draining": self.draining,
                "has_unfinished": self.has_unfinished}
