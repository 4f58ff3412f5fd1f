"""Tasks: the task/environment interface, the built-in tasks (addition; count_up, whose answers have
long-tailed lengths), your own data (`DataTask`: parquet / JSON / save_to_disk files), the tiny
base model and its supervised warm-up."""

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
from inflight.tasks.data_task import DataReport, DataTask, reward_name, split_held_out
from inflight.tasks.dataset import DatasetError, JsonlTask, load_jsonl, load_problems
from inflight.tasks.env_reward import environment_reward
from inflight.tasks.registry import BUILTIN_TASKS, make_builtin_task
from inflight.tasks.tokenizer import make_char_tokenizer
from inflight.tasks.tool_env import ToolEnv, register_tool

__all__ = [
    "BASE_MODEL_SHAPE",
    "BUILTIN_TASKS",
    "COUNT_UP_CHARS",
    "AdditionTask",
    "ChainAdditionEnv",
    "ChainAdditionTask",
    "CountUpTask",
    "DataReport",
    "DataTask",
    "DatasetError",
    "Environment",
    "JsonlTask",
    "Problem",
    "SingleTurnEnv",
    "StepResult",
    "Task",
    "ToolEnv",
    "WarmupReport",
    "build_base_model",
    "environment_reward",
    "load_jsonl",
    "load_problems",
    "make_builtin_task",
    "make_char_tokenizer",
    "reward_name",
    "split_held_out",
    "register_tool",
    "teacher_forced_accuracy",
    "warm_up",
]
