"""The built-in tasks by name (`job.task`): what `inflight train` and `inflight bench rl` build."""

from __future__ import annotations

from typing import Any

from inflight.tasks.addition import AdditionTask, ChainAdditionTask
from inflight.tasks.base import Task
from inflight.tasks.count_up import CountUpTask

BUILTIN_TASKS: dict[str, type[Task]] = {
    "addition": AdditionTask,
    "chain_addition": ChainAdditionTask,
    "count_up": CountUpTask,
}


def make_builtin_task(name: str, tokenizer: Any = None, **kwargs: Any) -> Task:
    """The built-in task `name` (see `BUILTIN_TASKS`) with `tokenizer` (None: the task's own
    character tokenizer); `kwargs` (num_train, num_eval, seed, ...) go to its constructor."""
    if name not in BUILTIN_TASKS:
        raise ValueError(f"unknown built-in task {name!r}; choose one of {', '.join(BUILTIN_TASKS)}")
    return BUILTIN_TASKS[name](tokenizer, **kwargs)
