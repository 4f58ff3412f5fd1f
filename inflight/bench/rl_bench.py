"""`inflight bench rl`: fully-async against synchronous GRPO on the same task, model and machine.

Both modes start from the same warmed-up base model and run for the same RL time budget, in
alternation (`--repeats` rounds), so background load hits both alike. Reported per mode: steps/s,
samples/s, held-out greedy accuracy after, and the time to first reach `--target` held-out accuracy
(evaluated every `--eval-interval` steps); then the async / sync ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="inflight bench rl", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a warmed-up model dir (default: build + warm up)")
    parser.add_argument("--seconds", type=float, default=60.0, help="RL time per run (default 60)")
    parser.add_argument("--repeats", type=int, default=1, help="rounds of (async, sync) runs (default 1)")
    parser.add_argument("--target", type=float, default=0.6, help="held-out accuracy to time (default 0.6)")
    parser.add_argument("--eval-interval", type=int, default=25, help="steps between evaluations")
    parser.add_argument("--output-dir", default="runs/bench_rl")
    parser.add_argument("overrides", nargs="*", help="config overrides for both modes (job.*, trainer.*, ...)")
    return parser


def _time_to(records: list[dict[str, Any]], target: float) -> float | None:
    for r in records:
        if (r.get("eval/accuracy") or 0.0) >= target:
            return r.get("time")
    return None


def main(argv: list[str] | None = None) -> int:
    from rich.console import Console

    from inflight.train.main import make_task, prepare_base_model, resolve_config, run_job
    from inflight.train.metrics import read_metrics

    args = build_parser().parse_args(argv)
    console = Console()

    def say(text: str) -> None:
        console.print(text, highlight=False)

    out = Path(args.output_dir)
    common = [*args.overrides, "job.progress=false", "job.max_steps=null", "job.plot=false", "job.log_interval=1000000",
              f"job.max_train_seconds={args.seconds}", f"job.eval_interval={args.eval_interval}"]
    cfg, job = resolve_config(None, [*common, f"job.output_dir={out / 'base'}"])
    task = make_task(cfg, job)
    model = args.model
    if model is None:
        prepare_base_model(cfg, job, task, say)
        model = cfg.trainer.policy.model.path
    results: dict[str, list[dict[str, Any]]] = {"fully_async": [], "sync": []}
    for rnd in range(args.repeats):
        for mode, enabled in (("fully_async", "true"), ("sync", "false")):
            run_dir = out / f"{mode}-{rnd}"
            cfg, job = resolve_config(None, [*common, f"trainer.policy.model.path={model}",
                                             f"trainer.fully_async.enabled={enabled}", f"job.output_dir={run_dir}"])
            load = os.getloadavg()[0]
            started = time.perf_counter()
            summary = asyncio.run(run_job(cfg, job, make_task(cfg, job), lambda _t: None))
            records = [r for r in read_metrics(run_dir / "metrics.jsonl") if "reward" in r]
            row = {"steps_per_s": summary["steps"] / summary["train_seconds"],
                   "samples_per_s": summary["samples_per_s"], "before": summary["before"],
                   "after": summary["after"], "time_to_target_s": _time_to(records, args.target),
                   "load_before": load, "wall_s": time.perf_counter() - started}
            results[mode].append(row)
            say(f"{mode:>11} round {rnd}: {row['steps_per_s']:.2f} steps/s, {row['samples_per_s']:.0f} samples/s, "
                f"accuracy {row['before']:.1%} -> {row['after']:.1%}, time to {args.target:.0%}: "
                f"{row['time_to_target_s'] if row['time_to_target_s'] is not None else 'not reached'}"
                f" (load {load:.1f})")
    mean = {m: {k: statistics.mean(r[k] for r in rows) for k in ("steps_per_s", "samples_per_s", "after")}
            for m, rows in results.items()}
    ratio = mean["fully_async"]["samples_per_s"] / mean["sync"]["samples_per_s"]
    say(f"fully-async / sync throughput: {ratio:.2f}x (samples/s {mean['fully_async']['samples_per_s']:.0f} vs "
        f"{mean['sync']['samples_per_s']:.0f}); accuracy after {args.seconds:.0f} s: "
        f"{mean['fully_async']['after']:.1%} vs {mean['sync']['after']:.1%}")
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_rl.json").write_text(json.dumps({"args": vars(args), "results": results, "mean": mean,
                                                   "throughput_ratio": ratio}, indent=2))
    return 0
