"""ConfigError: one exception that lists every violation of a configuration at once."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Violation:
    """One broken rule: the dotted `key`, the offending `value`, the `rule` it breaks and the `fix`."""

    key: str
    value: Any
    rule: str
    fix: str

    def __str__(self) -> str:
        return f"{self.key}={self.value!r}: {self.rule}. Fix: {self.fix}"


class ConfigError(ValueError):
    """Raised by `validate` / `load_config`; `.violations` holds every `Violation`, in order."""

    def __init__(self, violations: Iterable[Violation]):
        self.violations: list[Violation] = list(violations)
        n = len(self.violations)
        lines = [f"{n} configuration violation{'s' if n != 1 else ''}:"]
        lines += [f"  - {v}" for v in self.violations]
        super().__init__("\n".join(lines))

    @property
    def keys(self) -> list[str]:
        """The dotted keys of the violations, in order (a key may appear more than once)."""
        return [v.key for v in self.violations]
