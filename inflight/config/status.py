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


Choices = tuple[str, ...] | None
"""A string key's allowed values (validation refuses others, suggesting the closest); None: any."""


def _field(default: Any, factory: Callable[[], Any] | None, status: KeyStatus, skyrl: bool,
           example: bool = False, choices: Choices = None, aliases: dict[str, str] | None = None) -> Any:
    meta = {"status": status, "skyrl": skyrl, "example": example, "choices": choices,
            "aliases": aliases or {}}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def skyrl(default: Any = None, *, factory: Callable[[], Any] | None = None, status: KeyStatus = KeyStatus(),
          choices: Choices = None, aliases: dict[str, str] | None = None) -> Any:
    """A SkyRL key with SkyRL's default (`factory` for lists and dicts); `choices`: its allowed values,
    `aliases`: other values read as one of them (SkyRL's spellings)."""
    return _field(default, factory, status, True, choices=choices, aliases=aliases)


def ours(default: Any = None, *, factory: Callable[[], Any] | None = None, status: KeyStatus = KeyStatus(),
         choices: Choices = None, aliases: dict[str, str] | None = None) -> Any:
    """A key of this project (SkyRL has none like it); `choices` and `aliases` as for `skyrl`."""
    return _field(default, factory, status, False, choices=choices, aliases=aliases)


def example(default: Any = None, *, factory: Callable[[], Any] | None = None, status: KeyStatus = KeyStatus(),
            choices: Choices = None, aliases: dict[str, str] | None = None) -> Any:
    """A key that one of SkyRL's example entry points adds to SkyRL's schema (its DAPO trainer, its
    agent integrations), under the example's name and default; `choices` and `aliases` as for `skyrl`."""
    return _field(default, factory, status, True, example=True, choices=choices, aliases=aliases)


def is_example(f: dataclasses.Field) -> bool:
    """Whether a schema field is a key of one of SkyRL's example entry points."""
    return bool(f.metadata.get("example", False))


def field_choices(f: dataclasses.Field) -> tuple[tuple[str, ...], dict[str, str]] | None:
    """A schema field's (allowed values, aliases), or None when it declares none."""
    choices = f.metadata.get("choices")
    return (tuple(choices), dict(f.metadata.get("aliases") or {})) if choices is not None else None


def field_status(f: dataclasses.Field) -> KeyStatus:
    """A schema field's status (a section field: implemented)."""
    return f.metadata.get("status", KeyStatus())


def is_skyrl(f: dataclasses.Field) -> bool:
    """Whether a schema field is one of SkyRL's keys."""
    return bool(f.metadata.get("skyrl", True))


def pending(what: str, runs: Callable[[Any], bool] | None = None) -> KeyStatus:
    """Refused for now: `what` is being built (values other than `runs`, default the default)."""
    return refused(f"{what} is not implemented yet", runs=runs)
