"""The status of every config key, declared next to its field: implemented, accepted or refused.

Every key of the schema is one of:
- **implemented**: the run does what the key says (SkyRL's meaning for SkyRL's keys);
- **accepted**: the key asks for a behaviour the run already has, or one that has no object here
  (e.g. `enforce_eager` on an engine without CUDA graphs); any valid value is taken and the reason
  is in the generated reference;
- **refused**: values other than those that run (by default: SkyRL's default) are refused by every
  run with the reason and a fix (`inflight.config.implemented.require_implemented`); `validate`
  accepts them, so a SkyRL config always loads and `--print-config` shows what a run would refuse.

`skyrl(...)` declares a SkyRL key (SkyRL's name and default), `example(...)` a key one of SkyRL's
example entry points adds (DAPO's overlong buffer, the agent examples' rate limit, ...), `ours(...)`
a key SkyRL lacks. The
validator, the generated reference (`inflight.config.reference`) and the refusals all read this
metadata, so a key's status lives in one place.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

IMPLEMENTED, ACCEPTED, REFUSED = "implemented", "accepted", "refused"


@dataclass(frozen=True)
class KeyStatus:
    """What a run does with a key. `note`: why it is accepted or refused (empty when implemented);
    `runs(value)`: the values a run takes (refused keys; None: only the default); `fix`: what to do
    instead of a refused value."""

    state: str = IMPLEMENTED
    note: str = ""
    runs: Callable[[Any], bool] | None = None
    fix: str = ""

    def takes(self, value: Any, default: Any) -> bool:
        """Whether a run takes `value` for a key with this status and `default`."""
        if self.state != REFUSED:
            return True
        return self.runs(value) if self.runs is not None else value == default


def accepted(note: str) -> KeyStatus:
    """A key whose requested behaviour the run already has (or which has no object here)."""
    return KeyStatus(ACCEPTED, note)


def refused(note: str, runs: Callable[[Any], bool] | None = None, fix: str = "") -> KeyStatus:
    """A key whose values other than `runs` (default: the key's default) a run refuses, with why."""
    return KeyStatus(REFUSED, note, runs, fix)


def gpu_only(what: str) -> KeyStatus:
    """Refused away from its default: `what` needs several GPUs or CUDA-only software."""
    return refused(f"{what} is not implemented (it needs several GPUs or CUDA-only software)")


def _field(default: Any, factory: Callable[[], Any] | None, status: KeyStatus, skyrl: bool,
           example: bool = False) -> Any:
    meta = {"status": status, "skyrl": skyrl, "example": example}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def skyrl(default: Any = None, *, factory: Callable[[], Any] | None = None,
          status: KeyStatus = KeyStatus()) -> Any:
    """A SkyRL key with SkyRL's default (`factory` for lists and dicts)."""
    return _field(default, factory, status, True)


def ours(default: Any = None, *, factory: Callable[[], Any] | None = None,
         status: KeyStatus = KeyStatus()) -> Any:
    """A key of this project (SkyRL has none like it)."""
    return _field(default, factory, status, False)


def example(default: Any = None, *, factory: Callable[[], Any] | None = None,
            status: KeyStatus = KeyStatus()) -> Any:
    """A key that one of SkyRL's example entry points adds to SkyRL's schema (its DAPO trainer, its
    agent integrations), under the example's name and default."""
    return _field(default, factory, status, True, example=True)


def is_example(f: dataclasses.Field) -> bool:
    """Whether a schema field is a key of one of SkyRL's example entry points."""
    return bool(f.metadata.get("example", False))


def field_status(f: dataclasses.Field) -> KeyStatus:
    """A schema field's status (a section field: implemented)."""
    return f.metadata.get("status", KeyStatus())


def is_skyrl(f: dataclasses.Field) -> bool:
    """Whether a schema field is one of SkyRL's keys."""
    return bool(f.metadata.get("skyrl", True))


def pending(what: str, runs: Callable[[Any], bool] | None = None) -> KeyStatus:
    """Refused for now: `what` is being built (values other than `runs`, default the default)."""
    return refused(f"{what} is not implemented yet", runs=runs)
