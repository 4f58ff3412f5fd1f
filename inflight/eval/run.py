"""Evaluate: N samples per problem of each named data set, scored, summarised as pass@k.

One runner serves `inflight eval` and the trainer's periodic evaluation: it takes a generator (the
training generator's `TaskGenerator`, so evaluation plays exactly the episodes training plays:
same prompt encoding, environments, turns and rewards) and data sets by name, and returns an
`EvalResult`: per data set `num_problems`, `num_samples`, `mean_reward`, `pass@k` for k in
`report_ks(n)` (a sample is correct when its reward is >= 1), `response_length`,
`truncated_fraction` and `reward_failures` (rewards that raised or timed out: those samples score 0);
and one record per sample. Records and metrics come out in data-set, problem
and sample order whatever order the requests finish in, so a seeded run writes identical files.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from inflight.eval.passk import mean_pass_at_k
from inflight.tasks.base import Problem, Task

CORRECT = 1.0 - 1e-9
"""A sample is correct when its reward is >= 1 (up to float rounding of summed rewards)."""


@dataclass
class EvalResult:
    """`metrics[data set] = {num_problems, num_samples, mean_reward, pass@1, ..., response_length,
    truncated_fraction, reward_failures}`; `samples`: one record per sample (`data`, `problem_id`,
    `sample`, `prompt`, `response`, `ground_truth`, `reward`, `correct`, `finish_reason`,
    `response_tokens`, `reward_error`: why the reward failed and scored 0, else null); `seconds`: wall
    time."""

    metrics: dict[str, dict[str, float]]
    samples: list[dict[str, Any]]
    n: int
    seconds: float = 0.0
    overall: dict[str, float] = field(default_factory=dict)

    @property
    def accuracy(self) -> float:
        """pass@1 over every problem of every data set (greedy with n=1: the accuracy)."""
        return self.overall["pass@1"]

    @property
    def mean_reward(self) -> float:
        return self.overall["mean_reward"]

    def log_metrics(self, prefix: str = "eval") -> dict[str, float]:
        """Flat keys for metrics.jsonl / TensorBoard: `eval/<data set>/<metric>`, plus
        `eval/accuracy` and `eval/mean_reward` over all data sets and `eval/seconds`."""
        out = {f"{prefix}/{name}/{key}": float(value)
               for name, m in self.metrics.items() for key, value in m.items()}
        out.update({f"{prefix}/accuracy": self.accuracy, f"{prefix}/mean_reward": self.mean_reward,
                    f"{prefix}/seconds": self.seconds})
        return out

    def write(self, out_dir: str | Path) -> Path:
        """`metrics.json` (per data set) and `samples.jsonl` (one line per sample) in `out_dir`."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "metrics.json").write_text(json.dumps(self.metrics, indent=2) + "\n")
        with (out / "samples.jsonl").open("w") as f:
            for record in self.samples:
                f.write(json.dumps(record, ensure_ascii=False, default=_shown) + "\n")
        return out


def _shown(value: Any) -> str:
    """What samples.jsonl writes for a value JSON has no form for: a prompt's decoded image as
    `<image WxH>` (its pixels stay in the data file), anything else as its `str`."""
    size = getattr(value, "size", None)
    if hasattr(value, "getpixel") and isinstance(size, tuple):
        return f"<image {size[0]}x{size[1]}>"
    return str(value)


GroupFn = Callable[[Problem], Awaitable[Any]]
"""`async (problem) -> TrajectoryGroup` with `n` trajectories (a `TaskGenerator`)."""


async def evaluate(
    generate: GroupFn,
    datasets: Mapping[str, Sequence[Problem]],
    decode: Callable[[Sequence[int]], str],
    n: int,
    concurrency: int | None = None,
    on_problem: Callable[[int], None] | None = None,
) -> EvalResult:
    """Generate `n` samples for every problem of every data set through `generate`, score them,
    and summarise. `decode` turns response token ids into the text that is recorded;
    `concurrency` bounds the problems in flight (None: all at once); `on_problem(samples)` is called
    as each problem completes (progress bars)."""
    if n < 1:
        raise ValueError(f"n (samples per problem) must be >= 1, got {n}")
    empty = [name for name, problems in datasets.items() if not problems]
    if empty:
        raise ValueError(f"nothing to evaluate in data set(s) {', '.join(empty)}: they hold no problems")
    gate = asyncio.Semaphore(concurrency) if concurrency else None

    async def one(problem: Problem) -> Any:
        if gate is None:
            group = await generate(problem)
        else:
            async with gate:
                group = await generate(problem)
        if len(group.trajectories) != n:
            raise RuntimeError(f"the generator returned {len(group.trajectories)} samples for problem "
                               f"{problem.id!r}, expected n={n}")
        if on_problem is not None:
            on_problem(n)
        return group

    started = time.perf_counter()
    named = list(datasets.items())
    results = await asyncio.gather(*(asyncio.gather(*(one(p) for p in problems)) for _, problems in named))
    seconds = time.perf_counter() - started
    metrics, samples = {}, []
    for (name, problems), groups in zip(named, results, strict=True):
        records = [_record(name, p, i, t, decode) for p, g in zip(problems, groups, strict=True)
                   for i, t in enumerate(g.trajectories)]
        metrics[name] = summarise(records, n)
        samples += records
    return EvalResult(metrics, samples, n, seconds, summarise(samples, n))


def _record(
    data: str, problem: Problem, sample: int, traj: Any, decode: Callable[[Sequence[int]], str]
) -> dict[str, Any]:
    reward = float(traj.reward)
    return {
        "data": data, "problem_id": problem.id, "sample": sample, "prompt": problem.prompt,
        "response": decode(traj.response_ids), "ground_truth": problem.answer, "reward": reward,
        "correct": reward >= CORRECT,
        "finish_reason": traj.finish_reason, "response_tokens": int(traj.num_generated),
        "reward_error": traj.info.get("reward_error") if getattr(traj, "reward_failed", False) else None,
    }


def summarise(records: Sequence[dict[str, Any]], n: int) -> dict[str, float]:
    """The metrics of sample records (`n` per problem, grouped by (data, problem_id))."""
    correct: dict[tuple[str, str], int] = {}
    for r in records:
        key = (r["data"], r["problem_id"])
        correct[key] = correct.get(key, 0) + int(r["correct"])
    total = len(records)
    return {
        "num_problems": len(correct),
        "num_samples": total,
        "mean_reward": sum(r["reward"] for r in records) / total,
        **mean_pass_at_k(list(correct.values()), n),
        "response_length": sum(r["response_tokens"] for r in records) / total,
        "truncated_fraction": sum(r["finish_reason"] == "length" for r in records) / total,
        "reward_failures": sum(r.get("reward_error") is not None for r in records),
    }


def eval_sets(task: Task, limit: int | None = None) -> dict[str, list[Problem]]:
    """The held-out problems of `task` by data-set name (at most `limit` per set).

    A task that holds several validation sets may say so with `eval_sets() -> {name: problems}`.
    Otherwise a problem's set is its `meta["dataset"]`, else the file it was read from (`meta["source"]`
    = `<path>:<row>`, as the data task records it; named by `dataset_names`), else the task's name."""
    own = getattr(task, "eval_sets", None)
    if callable(own):
        named = {str(k): list(v) for k, v in own().items()}
    else:
        problems = list(task.eval_problems())
        files = dataset_names(list(dict.fromkeys(f for f in map(source_file, problems) if f is not None)))
        named = {}
        for p in problems:
            name = p.meta.get("dataset") or files.get(source_file(p) or "") or task.name
            named.setdefault(str(name), []).append(p)
    return {k: v[:limit] if limit is not None else v for k, v in named.items()}


def source_file(problem: Problem) -> str | None:
    """The data file a problem was read from (`meta["source"]` = `<path>:<row>`), if recorded."""
    source = problem.meta.get("source")
    return str(source).rsplit(":", 1)[0] if source else None


def dataset_names(paths: Sequence[str | Path]) -> dict[str, str]:
    """Each data file's set name: its stem (`gsm8k_test.parquet` -> `gsm8k_test`), or
    `<parent>/<stem>` for files whose stems collide."""
    stems = [Path(p).stem if Path(p).suffix else Path(p).name for p in paths]
    names = {str(p): f"{Path(p).parent.name}/{s}" if stems.count(s) > 1 else s
             for p, s in zip(paths, stems, strict=True)}
    if len(set(names.values())) < len(names):
        raise ValueError(f"data sets {', '.join(map(str, paths))} have the same names; "
                         "give each file a distinct name")
    return names
