"""Tasks: the task/environment interface, the built-in addition task, JSONL datasets, the tiny
base model and its supervised warm-up, and greedy evaluation."""

from inflight.tasks.addition import AdditionTask, ChainAdditionEnv, ChainAdditionTask
from inflight.tasks.base import Environment, Problem, SingleTurnEnv, StepResult, Task
from inflight.tasks.base_model import (
    BASE_MODEL_SHAPE,
    WarmupReport,
    build_base_model,
    teacher_forced_accuracy,
    warm_up,
)
from inflight.tasks.dataset import DatasetError, JsonlTask, load_jsonl
from inflight.tasks.tokenizer import make_char_tokenizer

__all__ = [
    "BASE_MODEL_SHAPE",
    "AdditionTask",
    "ChainAdditionEnv",
    "ChainAdditionTask",
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
    "make_char_tokenizer",
    "teacher_forced_accuracy",
    "warm_up",
]
