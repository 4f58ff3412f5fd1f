"""`inflight bench rl`: fully-async against synchronous GRPO on the same task, model and machine.

Both modes start from the same warmed-up base model and run for the same RL time budget, in
alternation (`--repeats` rounds), so background load hits both alike; or, with `--steps`, for the
same number of RL steps (a budget in work, the same on a busy machine), `--seconds` then only a cap
that a line reports when it ends a run early. The default task, `count_up`, has long-tailed answer
lengths (most a few tokens, a few ~60), the stragglers a synchronous step waits for; `--task
addition` runs the short-answer task. The trainer (this process) and the engine
(its child process) are pinned to different cores (`--no-pin` leaves placement to the OS).
Reported per mode: steps/s, samples/s, held-out greedy accuracy after, the time to first reach
`--target` held-out accuracy (evaluated every `--eval-interval` steps), the generated length
percentiles (p50/p90/p99/max tokens), the CPU time other processes took during the run; then the
async / sync samples/s ratio and the reference answers' length percentiles.

The bound on that ratio is measured in the same run, from the synchronous run's own phases: its
steps alternate generation alone (the engine producing the step's groups while the trainer waits,
`timing/wait_s`) and training alone (the train step and the weight sync, `timing/train_s` +
`timing/sync_s`), so an overlap of the two can at best turn (generate + train) into
max(generate, train) per step. The report gives the bound and async/sync as a fraction of it.
The bound assumes the two cores compute independently; the run first measures whether they do
(`core_sharing.core_independence`: a VM's two vCPUs can be SMT siblings of one physical core) and
says so when they do not.

Placement (`--placement`): by default the trainer's core runs only the policy's training thread, and
the rollout loop (the episode coroutines, the engine pipe's replies) runs beside the engine, as a
generator beside its engines does in SkyRL or verl; `process` puts the whole trainer process there.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import statistics
import threading
import time
from pathlib import Path
from typing import Any

DEFAULT_TARGETS = {"addition": 0.6, "chain_addition": 0.6, "count_up": 0.45}
"""Held-out accuracy to time per task (warm-ups stop near 30%)."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="inflight bench rl", description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", default="count_up", choices=sorted(DEFAULT_TARGETS),
                        help="built-in task (default count_up: long-tailed answer lengths)")
    parser.add_argument("--model", default=None,
                        help="a warmed-up model dir for the task (default: build + warm up)")
    parser.add_argument(
        "--seconds",
        type=float,
        default=60.0,
        help="RL time per run (default 60); with --steps only a cap, reported when it ends a run",
    )
    parser.add_argument("--steps", type=positive_int, default=None,
                        help="RL steps per run: a budget in work, the same on a busy machine (default: none, "
                             "each run trains for --seconds)")
    parser.add_argument("--repeats", type=int, default=1, help="rounds of (async, sync) runs (default 1)")
    parser.add_argument("--target", type=float, default=None,
                        help="held-out accuracy to time (default per task)")
    parser.add_argument("--eval-interval", type=int, default=25, help="steps between evaluations")
    parser.add_argument("--pin", action=argparse.BooleanOptionalAction, default=True,
                        help="pin trainer and engine to separate cores (default on)")
    parser.add_argument(
        "--placement",
        default="training-thread",
        choices=PLACEMENTS,
        help="what the trainer's core runs when pinned: the policy's training thread alone "
        "(default; the rollout loop runs beside the engine) or the whole trainer process",
    )
    parser.add_argument("--output-dir", default="runs/bench_rl")
    parser.add_argument("overrides", nargs="*",
                        help="config overrides for both modes (job.*, trainer.*, ...)")
    return parser


def positive_int(text: str) -> int:
    """argparse type of a step budget: an int >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text}: give a number of steps >= 1")
    return value


def _time_to(records: list[dict[str, Any]], target: float) -> float | None:
    for r in records:
        if (r.get("eval/accuracy") or 0.0) >= target:
            return r.get("time")
    return None


# ---- placement and CPU accounting ---------------------------------------------------------------
def _threads_of(pid: int) -> list[int]:
    try:
        return [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return []


def children_of(pid: int) -> list[int]:
    """Ids of the live child processes of `pid`: from its threads' `children` lists in /proc (a
    few small reads), else from a scan of every process's parent id."""
    if Path(f"/proc/{pid}/task/{pid}/children").exists():  # not on kernels without CONFIG_PROC_CHILDREN
        return [int(c) for t in _threads_of(pid) for c in _read(f"/proc/{pid}/task/{t}/children").split()]
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            stat = _read(f"/proc/{entry}/stat")
            if stat and int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry))
    return out


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def pin(pid: int, cores: set[int], skip: set[int] = frozenset()) -> set[int]:
    """Restrict every thread of process `pid` but those in `skip` to `cores` (affinity is per
    thread on Linux); returns the ids of the threads pinned."""
    pinned = set()
    for tid in _threads_of(pid):
        if tid not in skip:
            try:
                os.sched_setaffinity(tid, cores)
                pinned.add(tid)
            except OSError:  # the thread ended meanwhile
                pass
    return pinned


PLACEMENTS = ("training-thread", "process")
"""`--placement`: what runs on the trainer's core. `training-thread`: only the policy's training
thread, the trainer process's other threads (the rollout loop, the engine pipe's reply thread)
beside the engine; `process`: the whole trainer process."""


class CorePinning:
    """While active, the training side runs on the first allowed core and the generation side on
    the second: the engine process (every child this process starts) and, with placement
    `training-thread`, every thread of this process but the policy's training thread
    (`inflight.train.policy.TRAIN_THREAD_NAME`), which gets the first core alone. A watcher pins
    new threads every 0.2 s, since threads a child started before its first pinning keep the core
    they were born on, and the training thread is born on the core of the thread that starts it.
    A pass is cheap: the threads not pinned yet, new children looked for every 2 s. Does nothing
    when disabled or when fewer than two cores are allowed."""

    def __init__(
        self, enabled: bool = True, interval_s: float = 0.2, placement: str = "training-thread"
    ) -> None:
        if placement not in PLACEMENTS:
            raise ValueError(f"placement {placement!r} must be one of {list(PLACEMENTS)}")
        self.saved = sorted(os.sched_getaffinity(0))
        self.enabled = enabled and len(self.saved) >= 2
        self.trainer_cores, self.engine_cores = {self.saved[0]}, {self.saved[-1]}
        self.placement = placement
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._watcher: threading.Thread | None = None

    def describe(self) -> dict[str, Any]:
        """Which cores each side runs on (None: not pinned) and what the trainer's core runs."""
        if not self.enabled:
            return {"trainer": None, "engine": None, "placement": None}
        return {"trainer": sorted(self.trainer_cores), "engine": sorted(self.engine_cores),
                "placement": self.placement}

    def __enter__(self) -> CorePinning:
        if self.enabled:
            own = self.engine_cores if self.placement == "training-thread" else self.trainer_cores
            pin(os.getpid(), own)
            self._watcher = threading.Thread(target=self._watch, daemon=True, name="core-pinning")
            self._watcher.start()
        return self

    def _watch(self, look_every: int = 10) -> None:
        pinned: dict[int, set[int]] = {}  # child pid -> its threads pinned so far
        training: set[int] = set()  # training threads given the trainer's core
        passes = 0
        while not self._stop.wait(self.interval_s):
            if not pinned or passes % look_every == 0:  # new children are rare: looked for less often
                pinned = {c: pinned.get(c, set()) for c in children_of(os.getpid())}
            passes += 1
            for child, done in pinned.items():
                done |= pin(child, self.engine_cores, skip=done)
            if self.placement == "training-thread":
                for tid in training_threads() - training:
                    with contextlib.suppress(OSError):  # the thread ended meanwhile
                        os.sched_setaffinity(tid, self.trainer_cores)
                    training.add(tid)

    def __exit__(self, *exc: object) -> None:
        if self._watcher is not None:
            self._stop.set()
            self._watcher.join()
            pin(os.getpid(), set(self.saved))


def training_threads() -> set[int]:
    """Native ids of this process's live policy training threads."""
    from inflight.train.policy import TRAIN_THREAD_NAME

    return {t.native_id for t in threading.enumerate()
            if t.name.startswith(TRAIN_THREAD_NAME) and t.native_id is not None and t.is_alive()}


def _busy_s() -> float:
    fields = [float(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0.0)  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _own_cpu_s() -> float:
    t = os.times()  # children count once reaped: the engine process is waited for at close
    return t.user + t.system + t.children_user + t.children_system


def _trainer_cpu_s() -> float:
    t = os.times()
    return t.user + t.system


class CpuMeter:
    """CPU seconds this process and its reaped children used over a span, this process's alone
    (the trainer's: the train steps, the rollout loop's Python, and the run's setup and
    evaluations), and the rest of the machine's busy CPU time (other processes: the load that hit
    this run)."""

    def __enter__(self) -> CpuMeter:
        self.t0, self.busy0, self.own0 = time.perf_counter(), _busy_s(), _own_cpu_s()
        self.trainer0 = _trainer_cpu_s()
        return self

    def __exit__(self, *exc: object) -> None:
        wall = time.perf_counter() - self.t0
        own, busy = _own_cpu_s() - self.own0, _busy_s() - self.busy0
        other = max(0.0, busy - own)
        self.result = {"wall_s": wall, "own_cpu_s": own, "other_cpu_s": other,
                       "trainer_cpu_s": _trainer_cpu_s() - self.trainer0,
                       "other_cpu_share": other / max(wall * (os.cpu_count() or 1), 1e-9)}


# ---- the runs -----------------------------------------------------------------------------------
def record_response_lengths(task) -> list[int]:
    """Make `task` note the tokens (plus EOS) of every training response it scores, held-out
    evaluations left out; returns the list it fills. Single-turn tasks only (they score through
    `task.reward`); the step metrics hold only means, and the tail is what this bench is about."""
    from inflight.chat.turns import encode as encode_text
    from inflight.tasks.base import is_bounded

    lengths: list[int] = []
    held_out = {p.id for p in task.eval_problems()}
    score = task.reward

    def reward(problem, response: str) -> float:
        if problem.id not in held_out:
            # + EOS; a response cut off at the limit has none
            # not task.encode: its memo is for prompts, every response would evict one
            lengths.append(min(len(encode_text(task.tokenizer, response)) + 1, task.max_new_tokens))
        return score(problem, response)

    reward.bounded = is_bounded(score)  # run where the unwrapped reward would (inline or in a thread)
    task.reward = reward  # an instance attribute: the environments call task.reward
    return lengths


def make_bench_task(cfg, job):
    """The job's task; built-in tasks get their own tokenizer unless a model directory is set."""
    from inflight.tasks import BUILTIN_TASKS, make_builtin_task

    if job.task not in BUILTIN_TASKS:
        from inflight.train.main import make_task

        return make_task(cfg, job)
    tokenizer = None
    if cfg.trainer.policy.model.path is not None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(cfg.trainer.policy.model.path)
    return make_builtin_task(job.task, tokenizer, num_train=job.num_train, num_eval=job.num_eval,
                             seed=cfg.trainer.seed)


def prepare_model(cfg, job, task, say, shape: dict[str, Any] | None = None) -> str:
    """Build the tiny base model (`shape`: overrides of its Qwen2 config) with the task's tokenizer
    and warm it up; returns its directory."""
    from inflight.tasks import build_base_model, warm_up
    from inflight.train.main import warmup_outcome, warmup_plan

    path = Path(job.base_model_dir or Path(job.output_dir) / "base_model")
    say(
        f"building the {'base model ' + str(shape) if shape else 'tiny base model'} for {task.name} "
        f"in {path} and warming it up ({warmup_plan(job)})"
    )
    build_base_model(path, seed=cfg.trainer.seed, tokenizer=task.tokenizer, **(shape or {}))
    report = warm_up(path, task, steps=job.warmup_steps, batch_size=job.warmup_batch_size, lr=job.warmup_lr,
                     max_seconds=job.warmup_max_seconds, target_accuracy=job.warmup_target_accuracy,
                     seed=cfg.trainer.seed, log=say, threads=job.warmup_threads)
    say(warmup_outcome(report))
    return str(path)


def run_mode(common: list[str], model: str, enabled: bool, run_dir: Path, target: float,
             pinning: bool, placement: str = "training-thread", base: str = "default") -> dict[str, Any]:
    """One RL run (fully async when `enabled`) from `model`, of the config `base` (`bench_config`);
    its row of the result."""
    from inflight.tasks.lengths import percentiles
    from inflight.tracking.metrics import read_metrics
    from inflight.train.main import run_job

    cfg, job = bench_config([*common, f"trainer.policy.model.path={model}",
                                     f"trainer.fully_async.enabled={str(enabled).lower()}",
                                     f"job.output_dir={run_dir}"], base)
    task = make_bench_task(cfg, job)
    lengths = record_response_lengths(task)
    load = os.getloadavg()[0]
    cores = CorePinning(pinning, placement=placement)
    independence = measure_core_independence(cores)
    with cores, CpuMeter() as meter:
        summary = asyncio.run(run_job(cfg, job, task, lambda _t: None))
    everything = read_metrics(run_dir / "metrics.jsonl")
    records = [r for r in everything if "reward" in r]  # the steps (evaluations may be records of their own)
    return {**phase_seconds(records), "steps_per_s": summary["steps"] / summary["train_seconds"],
            "trainer_cpu_per_step_s": meter.result["trainer_cpu_s"] / max(summary["steps"], 1),
            "samples_per_s": summary["samples_per_s"], "before": summary["before"], "after": summary["after"],
            "time_to_target_s": _time_to(everything, target),
            "response_length_tokens": percentiles(lengths), "eval_problems": len(task.eval_problems()),
            "load_before": load, "cores": cores.describe(), "core_independence": independence,
            "steps": summary["steps"], "time_capped": summary["time_capped"], **meter.result}


def say_time_capped(say, side: str, rnd: int, row: dict[str, Any], steps: int | None, seconds: float) -> None:
    """With a budget of `steps`, a line for a run that `seconds` (the cap) ended before them."""
    if steps is not None and row["steps"] < steps and row.get("time_capped", True):
        say(f"{side:>11} round {rnd}: stopped by the --seconds cap ({seconds:g} s) after {row['steps']} of "
            f"{steps} steps (a slow or busy machine): raise --seconds for the whole budget")


def phase_seconds(records: list[dict[str, Any]]) -> dict[str, float]:
    """Mean seconds per step spent waiting for generation (`generate_s`), training plus syncing
    (`train_s`), and the train step's own wall clock and CPU time (`step_wall_s`, `step_cpu_s`:
    a step beside generation that takes more wall time for the same CPU time waited for the
    trainer's core or its GIL) over a run's step records."""
    def mean(keys: tuple[str, ...]) -> float:
        return statistics.mean(sum(r.get(k, 0.0) for k in keys) for r in records) if records else 0.0

    return {"generate_s": mean(("timing/wait_s",)), "train_s": mean(("timing/train_s", "timing/sync_s")),
            "step_wall_s": mean(("train_s",)), "step_cpu_s": mean(("train_cpu_s",))}


def overlap_bound(sync_rows: list[dict[str, Any]]) -> float:
    """(generate + train) / max(generate, train) per synchronous step: the most any overlap of
    generation and training can gain over the synchronous loop on this run's phases."""
    generate = statistics.mean(r["generate_s"] for r in sync_rows)
    train = statistics.mean(r["train_s"] for r in sync_rows)
    return (generate + train) / max(generate, train, 1e-9)


def _say_row(say, mode: str, rnd: int, row: dict[str, Any], target: float) -> None:
    reached = row["time_to_target_s"]
    say(
        f"{mode:>11} round {rnd}: {row['steps_per_s']:.2f} steps/s, {row['samples_per_s']:.0f} samples/s, "
        f"accuracy {row['before']:.1%} -> {row['after']:.1%}, time to {target:.0%}: "
        f"{f'{reached:.0f} s' if reached is not None else 'not reached'}, response tokens p50/p90/p99/max "
        f"{_quartet(row['response_length_tokens'])}; train step {row['step_wall_s'] * 1e3:.0f} ms wall, "
        f"{row['step_cpu_s'] * 1e3:.0f} ms CPU; trainer process CPU (setup included) "
        f"{row['trainer_cpu_per_step_s'] * 1e3:.0f} ms a step (load {row['load_before']:.1f}, "
        f"other processes {row['other_cpu_share']:.0%} of the CPUs"
        + (
            f", core independence {row['core_independence']:.0%}"
            if row["core_independence"] is not None
            else ""
        )
        + ")"
    )


def _quartet(stats: dict[str, float]) -> str:
    return "/".join(f"{stats[k]:.0f}" for k in ("p50", "p90", "p99", "max"))


SHARED_CORE_BELOW = 0.8
"""A core independence below this: the two cores behave as SMT siblings of one physical core."""


def measure_core_independence(pinning: CorePinning) -> float | None:
    """`core_sharing.core_independence` of the trainer's and the engine's cores (None unpinned).
    Measured before every run: a VM's vCPUs can move between separate cores and SMT siblings of
    one core while the bench runs (seen here: 56% and 99% on one machine a quarter of an hour apart)."""
    if not pinning.enabled:
        return None
    from inflight.bench.core_sharing import core_independence

    return core_independence(min(pinning.trainer_cores), min(pinning.engine_cores))


def _say_independence(say, rows: list[dict[str, Any]]) -> None:
    values = [r["core_independence"] for r in rows if r["core_independence"] is not None]
    if not values:
        return
    shared = min(values) < SHARED_CORE_BELOW
    say("core independence before each run (a matmul on the trainer's core beside one on the engine's, "
        f"over its speed alone): {', '.join(f'{v:.0%}' for v in values)}" + (
            "; below 80% the two cores shared one physical core (SMT siblings): generation and training "
            "overlapped slow each other there, which the overlap bound does not count" if shared else ""))


def summarize(results: dict[str, list[dict[str, Any]]]) -> tuple[dict[str, dict[str, float]], float]:
    """Per-mode means and the fully-async / sync samples/s ratio."""
    keys = (
        "steps_per_s",
        "samples_per_s",
        "after",
        "other_cpu_share",
        "generate_s",
        "train_s",
        "step_wall_s",
        "step_cpu_s",
        "trainer_cpu_per_step_s",
    )
    mean = {m: {k: statistics.mean(r[k] for r in rows) for k in keys} for m, rows in results.items()}
    return mean, mean["fully_async"]["samples_per_s"] / max(mean["sync"]["samples_per_s"], 1e-9)


def accuracy_gap(results: dict[str, list[dict[str, Any]]]) -> dict[str, float]:
    """Fully async's held-out accuracy after the run minus the synchronous run's, with the standard
    error of that difference (each mode's accuracy a binomial mean over its rounds' greedy answers):
    on 200 problems one round's accuracy moves by about 3.5 points by chance alone, so a gap of a
    point or two says nothing either way."""
    means, variances = {}, {}
    for mode, rows in results.items():
        n = sum(r["eval_problems"] for r in rows)
        p = sum(r["after"] * r["eval_problems"] for r in rows) / max(n, 1)
        means[mode], variances[mode] = p, p * (1 - p) / max(n, 1)
    return {"difference": means["fully_async"] - means["sync"],
            "standard_error": math.sqrt(variances["fully_async"] + variances["sync"])}


def _say_accuracy(say, gap: dict[str, float]) -> None:
    diff, se = gap["difference"], gap["standard_error"]
    verdict = ("at least the synchronous run's" if diff >= 0 else
               "below the synchronous run's by more than twice the standard error" if diff < -2 * se else
               "below the synchronous run's by less than twice the standard error: not told apart from it "
               "at this many held-out answers (more: job.num_eval, --repeats)")
    say(f"accuracy after the run, fully async minus sync: {diff * 100:+.1f} points, standard error "
        f"{se * 100:.1f} points: {verdict}")


def bench_config(overrides: list[str], base: str = "default"):
    """(cfg, job) of a bench run: the built-in demo job (`inflight.train.defaults`, what
    `examples/default.yaml` holds), or the config file at the absolute path `base`, with `overrides`."""
    import tempfile

    from inflight.train.main import resolve_config

    with tempfile.NamedTemporaryFile("w", suffix=".yaml") as config:  # `base:` is read from a config file
        config.write(f"base: {json.dumps(base)}\n")
        config.flush()
        return resolve_config(config.name, overrides)


def run_overrides(task: str | None, seconds: float, eval_interval: int, overrides: list[str],
                  steps: int | None = None) -> list[str]:
    """The overrides of every run of a bench on the built-in `task` (None: the data files its
    config names; `overrides`: the user's, after the task's): `seconds` of RL each, evaluated every
    `eval_interval` steps, quiet (no progress bar, plot or log lines); `steps` RL steps each
    (None: not capped in steps), `seconds` then only a cap."""
    from inflight.train.defaults import task_overrides

    # the warm-up's budget is work (the demo job's steps, a task's target accuracy), its time cap
    # generous, so a busy machine still gives every run the same starting model
    return [*(task_overrides(task) if task else []), *overrides, "job.progress=false",
            f"trainer.max_training_steps={steps or 'null'}", "job.plot=false", "job.log_interval=1000000",
            f"job.max_train_seconds={seconds}", f"job.eval_interval={eval_interval}"]


def main(argv: list[str] | None = None) -> int:
    from rich.console import Console

    from inflight.tasks.lengths import answer_length_stats

    args = build_parser().parse_args(argv)
    console = Console()

    def say(text: str) -> None:
        console.print(text, highlight=False)

    out = Path(args.output_dir)
    target = args.target if args.target is not None else DEFAULT_TARGETS[args.task]
    common = run_overrides(args.task, args.seconds, args.eval_interval, args.overrides, args.steps)
    cfg, job = bench_config([*common, f"job.output_dir={out / 'base'}"])
    task = make_bench_task(cfg, job)
    lengths = answer_length_stats(task)
    say(f"{task.name}: reference answer tokens (incl. EOS) p50/p90/p99/max {_quartet(lengths)}")
    model = args.model or prepare_model(cfg, job, task, say)
    results: dict[str, list[dict[str, Any]]] = {"fully_async": [], "sync": []}
    for rnd in range(args.repeats):
        for mode, enabled in (("fully_async", True), ("sync", False)):
            row = run_mode(common, model, enabled, out / f"{mode}-{rnd}", target, args.pin, args.placement)
            results[mode].append(row)
            _say_row(say, mode, rnd, row, target)
            say_time_capped(say, mode, rnd, row, args.steps, args.seconds)
    mean, ratio = summarize(results)
    bound = overlap_bound(results["sync"])
    in_run_order = [r for pair in zip(results["fully_async"], results["sync"], strict=True) for r in pair]
    _say_independence(say, in_run_order)
    gap = accuracy_gap(results)
    budget = f"{args.steps} steps" if args.steps else f"{args.seconds:.0f} s"
    say(
        f"fully-async / sync throughput: {ratio:.2f}x (samples/s "
        f"{mean['fully_async']['samples_per_s']:.0f} vs {mean['sync']['samples_per_s']:.0f}); "
        f"accuracy after {budget}: "
        f"{mean['fully_async']['after']:.1%} vs {mean['sync']['after']:.1%}"
    )
    say(
        "overlap bound measured in this run "
        f"(synchronous steps: generate {mean['sync']['generate_s'] * 1e3:.0f} ms, "
        f"train + sync {mean['sync']['train_s'] * 1e3:.0f} ms): {bound:.2f}x; fully async reached "
        f"{ratio / bound:.0%} of it"
    )
    _say_accuracy(say, gap)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_rl.json").write_text(json.dumps({
        "args": vars(args), "task": task.name, "target": target, "answer_length_tokens": lengths,
        "core_independence": [r["core_independence"] for r in in_run_order],
        "results": results, "mean": mean, "throughput_ratio": ratio, "overlap_bound": bound,
        "fraction_of_bound": ratio / bound, "accuracy_gap": gap}, indent=2))
    return 0
