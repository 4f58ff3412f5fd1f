"""The task / environment interface: problems, a verifiable reward, and episodes (`reset` / `step`).

A `Task` owns a tokenizer, its problems (training and held-out), how a prompt becomes token ids and
how a response is scored. Each trajectory is played against an `Environment` made by the task:
`reset()` gives the opening prompt, `step(response)` scores the model's turn and either ends the
episode or answers with an observation that is appended to the conversation (its tokens are not
trained on). Single-turn is the default (`SingleTurnEnv`: one response, scored, done).
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Problem:
    """One prompt with its reference answer; `id` is unique within a task's training set."""

    id: str
    prompt: str | list[dict[str, str]]
    """Text, or chat messages (`[{"role": "user", "content": ...}]`) for tasks with a chat template."""
    answer: str
    meta: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)


@dataclass
class StepResult:
    """What an environment returns for one model turn.

    `observation`: text appended after the model's turn when the episode goes on (None when done);
    `reward`: added to the trajectory's return; `done`: the episode is over.
    """

    observation: str | None
    reward: float
    done: bool
    info: dict[str, Any] = field(default_factory=dict)


class Environment(ABC):
    """One episode. `reset()` returns the prompt text; `step(response_text)` scores a turn."""

    max_turns: int = 1

    @abstractmethod
    def reset(self) -> str | list[dict[str, str]]: ...

    @abstractmethod
    def step(self, response: str) -> StepResult: ...


class SingleTurnEnv(Environment):
    """The default: the prompt, one response, the task's reward, done."""

    def __init__(self, task: Task, problem: Problem) -> None:
        self.task, self.problem = task, problem

    def reset(self) -> str | list[dict[str, str]]:
        return self.problem.prompt

    def step(self, response: str) -> StepResult:
        reward = self.task.reward(self.problem, response)
        return StepResult(None, reward, True, {"correct": reward >= 1.0})


class Task(ABC):
    """A training task: tokenizer, problems, reward, environments.

    Subclasses implement `train_problems`, `eval_problems` and `reward`; they may override
    `make_env` (multi-turn) and `encode_prompt` (e.g. to apply a chat template).
    """

    name: str = "task"
    max_new_tokens: int = 16
    """Most tokens generated per model turn."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    @abstractmethod
    def train_problems(self) -> Sequence[Problem]: ...

    @abstractmethod
    def eval_problems(self) -> Sequence[Problem]: ...

    @abstractmethod
    def reward(self, problem: Problem, response: str) -> float:
        """Score of `response` (decoded, without special tokens) for `problem`; 1.0 means correct."""

    def make_env(self, problem: Problem) -> Environment:
        return SingleTurnEnv(self, problem)

    def sample_problems(self, rng: random.Random, n: int) -> list[Problem]:
        """`n` training problems for the supervised warm-up (default: drawn from `train_problems`;
        generated tasks override it with fresh problems)."""
        return rng.choices(list(self.train_problems()), k=n)

    @property
    def stop_token_ids(self) -> list[int]:
        eos = self.tokenizer.eos_token_id
        return [] if eos is None else [int(eos)]

    def encode_prompt(self, prompt: str | list[dict[str, str]]) -> list[int]:
        """Token ids of an opening prompt (what `Environment.reset()` returned)."""
        if not isinstance(prompt, str):
            raise TypeError(f"{type(self).__name__} takes text prompts, not chat messages")
        return self.encode(prompt)

    def encode(self, text: str) -> list[int]:
        """Token ids of text (no special tokens added): prompts and environment observations."""
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=True)
