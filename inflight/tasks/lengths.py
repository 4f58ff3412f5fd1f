"""Length statistics of a task's reference answers in tokens (answer + EOS): how long-tailed they are."""

from __future__ import annotations

import math
from collections.abc import Sequence

from inflight.tasks.base import Problem, Task


def percentiles(values: Sequence[float]) -> dict[str, float]:
    """p50 / p90 / p99 (nearest rank), max and mean of `values` (all 0 when empty)."""
    if not values:
        return {"p50": 0.0, "p90": 0.0, "p99": 0.0, "max": 0.0, "mean": 0.0}
    ordered = sorted(values)

    def rank(q: float) -> float:
        return float(ordered[max(0, math.ceil(round(q * len(ordered), 9)) - 1)])

    return {"p50": rank(0.5), "p90": rank(0.9), "p99": rank(0.99), "max": float(ordered[-1]),
            "mean": sum(ordered) / len(ordered)}


def answer_lengths(task: Task, problems: Sequence[Problem] | None = None) -> list[int]:
    """Tokens of each reference answer plus its EOS (default: the training problems)."""
    problems = task.train_problems() if problems is None else problems
    return [len(task.encode(p.answer)) + 1 for p in problems]


def answer_length_stats(task: Task, problems: Sequence[Problem] | None = None) -> dict[str, float]:
    """`percentiles` of `answer_lengths`."""
    return percentiles(answer_lengths(task, problems))
