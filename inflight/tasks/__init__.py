"""Tasks: the task/environment interface, the built-in tasks (addition; count_up, whose answers have
long-tailed lengths), JSONL datasets, the tiny base model and its supervised warm-up."""

from inflight.tasks.addition import AdditionTask, ChainAdditionEnv, ChainAdditionTask
from inflight.tasks.base import Environment, Problem, SingleTurnEnv, StepResult, Task
from inflight.tasks.base_model import (
    BASE_MODEL_SHAPE,
    WarmupReport,
    build_base_model,
    teacher_forced_accuracy,
    warm_up,
)
from inflight.tasks.count_up import COUNT_UP_CHARS, CountUpTask
from inflight.tasks.dataset import DatasetError, JsonlTask, load_jsonl
from inflight.tasks.registry import BUILTIN_TASKS, make_builtin_task
from inflight.tasks.tokenizer import make_char_tokenizer

__all__ = [
    "BASE_MODEL_SHAPE",
    "BUILTIN_TASKS",
    "COUNT_UP_CHARS",
    "AdditionTask",
    "ChainAdditionEnv",
    "ChainAdditionTask",
    "CountUpTask",
    "DatasetError",
    "Environment",
    "JsonlTask",
    "Problem",
    "SingleTurnEnv",
    "StepResult",
    "Task",
    "WarmupReport",
    "build_base_model",
    "load_jsonl",
    "make_builtin_task",
    "make_char_tokenizer",
    "teacher_forced_accuracy",
    "warm_up",
]
