"""A built-in task with long-tailed output lengths: count up in steps, writing every running sum.

The prompt `a+d<b=` asks: starting from `a`, keep adding `d` while the total is below `b`, and write
each new total. `7+3<30=` is answered `10,13,16,19,22,25,28,31` then end-of-sequence; the final
number (the first total >= b) is the answer. The number of terms `n` is drawn from a truncated Zipf
law on 1..`max_terms` (P(n) ~ n^-`zipf_s`), so most answers are a few tokens long and a few run to
~60 (with the defaults p50 6, p90 24, p99 48, max 59 tokens incl. EOS): the stragglers a
synchronous RL step waits for. Each sum needs only the previous one (just written) and `d`, `b`
(in the prompt), so a ~1M-parameter model learns it in minutes.

Reward: partial credit, the count of leading running sums that are right over the longer of the
response and the answer (1 only for the exact answer; stopping early, running on past `b` or a wrong
sum all cost). A reward on the final number alone was measured to teach the policy to stop after one
sum (most problems have one), collapsing the length tail within ten steps; this one keeps it.
The held-out evaluation set (200 problems, fixed seed) never appears in training data.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Sequence
from functools import cached_property

from inflight.tasks.base import Problem, Task, bounded
from inflight.tasks.tokenizer import CHARS, make_char_tokenizer

EVAL_SEED = 2_000_003
COUNT_UP_CHARS = CHARS + ",<"
"""The addition alphabet plus `,` and `<` (appended, so the shared tokens keep their ids)."""


def running_sums(a: int, d: int, b: int) -> list[int]:
    """`a + d, a + 2d, ...` up to and including the first total >= b (needs d >= 1)."""
    if d < 1:
        raise ValueError(f"the step d={d} must be >= 1")
    totals, total = [], a
    while True:
        total += d
        totals.append(total)
        if total >= b:
            return totals


def make_problem(pid: str, a: int, d: int, b: int) -> Problem:
    """The problem `a+d<b=` with its scratchpad answer (`,`-joined running sums)."""
    totals = running_sums(a, d, b)
    return Problem(pid, f"{a}+{d}<{b}=", ",".join(map(str, totals)),
                   {"a": a, "d": d, "b": b, "terms": len(totals), "final": totals[-1]})


def prefix_credit(want: Sequence[str], got: Sequence[str]) -> float:
    """Leading items of `got` equal to `want`'s, over the longer length: 1.0 only when equal."""
    pairs = zip(got, want, strict=False)  # the shorter one ends the comparison
    right = sum(1 for _ in itertools.takewhile(lambda pair: pair[0] == pair[1], pairs))
    return right / max(len(got), len(want), 1)


def zipf_cum_weights(max_terms: int, s: float) -> list[float]:
    """Cumulative weights of P(n) ~ n^-s on n = 1..max_terms (for `random.choices`)."""
    return list(itertools.accumulate(n ** -s for n in range(1, max_terms + 1)))


class CountUpTask(Task):
    """`a+d<b=` -> the running sums of d from a up to the first >= b. `a` in 0..`max_start`, `d` in
    1..`max_step`, the term count Zipf(`zipf_s`) on 1..`max_terms`, `b` uniform among the values
    that give exactly that many terms."""

    name = "count_up"

    def __init__(
        self,
        tokenizer=None,
        num_train: int = 20_000,
        num_eval: int = 200,
        max_terms: int = 16,
        zipf_s: float = 1.5,
        max_start: int = 49,
        max_step: int = 9,
        seed: int = 0,
    ) -> None:
        super().__init__(tokenizer if tokenizer is not None else make_char_tokenizer(COUNT_UP_CHARS))
        self.num_train, self.num_eval, self.seed = num_train, num_eval, seed
        self.max_terms, self.max_start, self.max_step = max_terms, max_start, max_step
        self._cum = zipf_cum_weights(max_terms, zipf_s)
        largest = max_start + max_terms * max_step
        # every total has len(str(largest)) digits at most, plus a comma; EOS; one spare for run-ons
        self.max_new_tokens = max_terms * (len(str(largest)) + 1) + 1

    def draw(self, rng: random.Random) -> tuple[int, int, int]:
        """One random (a, d, b)."""
        n = rng.choices(range(1, self.max_terms + 1), cum_weights=self._cum)[0]
        a, d = rng.randint(0, self.max_start), rng.randint(1, self.max_step)
        return a, d, rng.randint(a + (n - 1) * d + 1, a + n * d)

    @cached_property
    def _eval(self) -> list[Problem]:
        rng, seen, out = random.Random(EVAL_SEED), set(), []
        while len(out) < self.num_eval:
            triple = self.draw(rng)
            if triple not in seen:
                seen.add(triple)
                out.append(make_problem(f"eval-{len(out)}", *triple))
        return out

    @cached_property
    def _held_out(self) -> frozenset[tuple[int, int, int]]:
        return frozenset((p.meta["a"], p.meta["d"], p.meta["b"]) for p in self._eval)

    def sample_problems(self, rng: random.Random, n: int) -> list[Problem]:
        """`n` fresh random problems, none from the held-out set."""
        out = []
        while len(out) < n:
            triple = self.draw(rng)
            if triple not in self._held_out:
                out.append(make_problem("sample", *triple))
        return out

    @cached_property
    def _train(self) -> list[Problem]:
        problems = self.sample_problems(random.Random(self.seed), self.num_train)
        return [make_problem(f"up-{i}", p.meta["a"], p.meta["d"], p.meta["b"])
                for i, p in enumerate(problems)]

    def train_problems(self) -> Sequence[Problem]:
        return self._train

    def eval_problems(self) -> Sequence[Problem]:
        return self._eval

    @bounded
    def reward(self, problem: Problem, response: str) -> float:
        return prefix_credit(problem.answer.split(","), response.strip().split(","))
