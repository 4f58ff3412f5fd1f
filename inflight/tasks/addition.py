"""The built-in task: multi-digit addition `a+b=` answered with the sum, then end-of-sequence.

Numbers have 1 to 3 digits (the digit count uniform, then the value uniform among numbers of that
many digits), so problems range from `3+4=` to `987+654=`. The reward is 1 for the exact sum and 0
otherwise. The held-out evaluation set (200 problems, fixed seed) never appears in training data.
`ChainAdditionEnv` is a multi-turn variant: after each answer the environment asks to add one more
number to it (`+c=`), which exercises loss masks for environment tokens.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from functools import cached_property

from inflight.tasks.base import Environment, Problem, StepResult, Task, bounded
from inflight.tasks.tokenizer import make_char_tokenizer

EVAL_SEED = 1_000_003


def random_number(rng: random.Random, max_digits: int = 3) -> int:
    digits = rng.randint(1, max_digits)
    low = 0 if digits == 1 else 10 ** (digits - 1)
    return rng.randint(low, 10**digits - 1)


def make_problem(index: int, a: int, b: int, prefix: str = "add") -> Problem:
    return Problem(f"{prefix}-{index}", f"{a}+{b}=", str(a + b), {"a": a, "b": b})


class AdditionTask(Task):
    """`a+b=` -> the sum. `num_train` training problems from `seed`, `num_eval` held-out ones."""

    name = "addition"
    max_new_tokens = 6  # at most 4 digits and EOS; one spare so a run-on answer ends with "length"

    def __init__(
        self,
        tokenizer=None,
        num_train: int = 20_000,
        num_eval: int = 200,
        max_digits: int = 3,
        seed: int = 0,
    ) -> None:
        super().__init__(tokenizer if tokenizer is not None else make_char_tokenizer())
        self.num_train, self.num_eval, self.max_digits, self.seed = num_train, num_eval, max_digits, seed

    @property
    def num_pairs(self) -> int:
        """How many distinct (a, b) problems exist."""
        return (10**self.max_digits) ** 2

    @cached_property
    def _eval(self) -> list[Problem]:
        if self.num_eval > self.num_pairs // 2:
            raise ValueError(f"num_eval={self.num_eval} is too large for {self.num_pairs} distinct problems "
                             f"of {self.max_digits}-digit numbers")
        rng = random.Random(EVAL_SEED)
        seen: set[tuple[int, int]] = set()
        out: list[Problem] = []
        while len(out) < self.num_eval:
            pair = (random_number(rng, self.max_digits), random_number(rng, self.max_digits))
            if pair not in seen:
                seen.add(pair)
                out.append(make_problem(len(out), *pair, prefix="eval"))
        return out

    @cached_property
    def _held_out(self) -> frozenset[tuple[int, int]]:
        return frozenset((p.meta["a"], p.meta["b"]) for p in self._eval)

    def sample_pairs(self, rng: random.Random, n: int) -> list[tuple[int, int]]:
        """`n` random (a, b) pairs, none from the held-out set."""
        out = []
        while len(out) < n:
            pair = (random_number(rng, self.max_digits), random_number(rng, self.max_digits))
            if pair not in self._held_out:
                out.append(pair)
        return out

    def sample_problems(self, rng: random.Random, n: int) -> list[Problem]:
        """`n` fresh random problems (from `sample_pairs`)."""
        return [make_problem(0, a, b, prefix="sample") for a, b in self.sample_pairs(rng, n)]

    @cached_property
    def _train(self) -> list[Problem]:
        pairs = self.sample_pairs(random.Random(self.seed), self.num_train)
        return [make_problem(i, a, b) for i, (a, b) in enumerate(pairs)]

    def train_problems(self) -> Sequence[Problem]:
        return self._train

    def eval_problems(self) -> Sequence[Problem]:
        return self._eval

    @bounded
    def reward(self, problem: Problem, response: str) -> float:
        return 1.0 if response.strip() == problem.answer else 0.0


class ChainAdditionEnv(Environment):
    """Multi-turn addition: answer `a+b=`, then the environment says `+c=` and the model adds c to
    its own previous answer, for `turns` turns. Reward: the fraction of turns answered correctly
    (a wrong answer ends the episode)."""

    def __init__(self, problem: Problem, extra: Sequence[int]) -> None:
        self.problem = problem
        self.extra = list(extra)
        self.max_turns = 1 + len(self.extra)
        self.turn = 0
        self.total = int(problem.answer)

    def reset(self) -> str:
        self.turn, self.total = 0, int(self.problem.answer)
        return self.problem.prompt

    @bounded
    def step(self, response: str) -> StepResult:
        correct = response.strip() == str(self.total)
        reward = (1.0 if correct else 0.0) / self.max_turns
        self.turn += 1
        if not correct or self.turn >= self.max_turns:
            return StepResult(None, reward, True, {"correct": correct, "turns": self.turn})
        c = self.extra[self.turn - 1]
        self.total += c
        return StepResult(f"+{c}=", reward, False, {"correct": True, "turns": self.turn})


class ChainAdditionTask(AdditionTask):
    """`AdditionTask` played as `ChainAdditionEnv` episodes with `turns` turns."""

    name = "chain_addition"

    def __init__(self, *args, turns: int = 2, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.turns = turns

    def make_env(self, problem: Problem) -> Environment:
        rng = random.Random(f"{self.seed}-{problem.id}")
        return ChainAdditionEnv(problem, [rng.randint(0, 9) for _ in range(self.turns - 1)])
