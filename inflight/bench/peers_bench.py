"""`inflight bench peers`: TRL's GRPOTrainer against inflight's synchronous and fully-async trainers,
from the same start weights, data, reward and hyperparameters, on the same machine.

Each round runs the three sides one after the other (the order rotates every round, so background
load and warm caches hit each side alike), with the round's seed (`trainer.seed` + round: the
training problems drawn and their order, sampling); every run gets `--seconds` of training, or
`--steps` training steps (a budget in work, the same on a busy machine; `--seconds` then only caps a
run, and a line says when it did). One
warmed-up base model (built once, `inflight.tasks.build_base_model` + `warm_up`, or `--model`) is
every run's start. TRL runs in its own venv (`scripts/trl_venv.sh`; TRL is not a dependency of the
package) as `trl_worker.py`, one process with `--trl-threads` torch threads (2: TRL's natural
setting on this machine); inflight's runs are `inflight train`'s (`rl_bench.run_mode`: the trainer in
this process, the engine in its child), unpinned as `inflight train` is unless `--pin`.

Aligned (`trl_side.trl_settings` reads them from the inflight run's resolved config): the start
weights and tokenizer, the training problems (written with inflight's prompt token ids, which TRL's
tokenization must equal) and the held-out problems, the reward (`trl_worker.REWARDS`, equal to the
task's own; for data files `inflight.rewards`' own file, `trl_worker.SHARED_REWARDS`), prompts per
step and group size, AdamW's learning rate (constant), betas, epsilon and weight decay, gradient
clipping, the PPO clip, GRPO's group-std advantages, the token-mean loss (TRL's `dapo`), no KL term,
float32, LoRA (peft's LoraConfig from the same arguments), the completion length, temperature /
top-p / top-k, and the greedy
held-out evaluation every `--eval-interval` steps, inside every side's clock (each evaluation is
recorded at the time its step ended; the evaluations before and after training are outside it).
What could not be aligned is listed in every report (`trl_side.NOT_ALIGNED`).

Workloads (`--workload`): `default` (the demo job, `examples/default.yaml`: addition, the 0.8M
base model), `count_up` (long-tailed answer lengths: generation dominates), `49m` (addition on a
model of `inflight bench engine`'s 49M shape, with the task's tokenizer: hidden 512, 13 layers, where
the engine's speed matters; its warm-up steps take seconds each on 2 cores, so reaching the
warm-up's 30% takes many minutes: `--model <output-dir>/base/base_model` reuses it), `smollm2` (a
real chat model, `--model DIR`, e.g. SmolLM2-135M-Instruct from `inflight models get
smollm2-135m-instruct`, trained as shipped, no warm-up: the runs start from the recipe
`examples/smollm2/config.yaml` instead of the demo job, its data files written by
`examples/smollm2/make_data.py`; prompts are chat messages through the model's chat template on both
sides, scored by `inflight.rewards`' gsm8k_flexible, with the recipe's LoRA).

Reported per side and run: held-out accuracy against wall-clock time (the curve and `--gains`'
times: the first evaluation at least that many points above the run's start), samples/s, accuracy
after, cores busy; per inflight side the ratios against TRL. Written to `--output-dir`:
`bench_peers.json` (everything), `bench_peers.md` (the table, the CPU named) and
`accuracy_vs_time.png`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from inflight.bench.common import MODEL_SHAPES, cpu_name
from inflight.bench.rl_bench import positive_int, say_time_capped

SIDES = ("trl", "sync", "fully_async")


@dataclass(frozen=True)
class PeersWorkload:
    """A workload of the bench: the built-in task (None: the recipe's data files), the base model's
    shape, overrides of the default job; or a recipe, a config file of the repository the runs start
    from instead of the default job, whose real model `--model` gives (no warm-up)."""

    task: str | None
    describe: str
    eval_interval: int
    shape: dict[str, Any] = field(default_factory=dict)
    overrides: tuple[str, ...] = ()
    recipe: str | None = None


_49M = {k: v for k, v in MODEL_SHAPES["50m"].items() if k != "vocab_size"}  # the task's tokenizer: 16 tokens

WORKLOADS: dict[str, PeersWorkload] = {
    "default": PeersWorkload("addition", "addition, the 0.8M tiny base model", 10),
    "count_up": PeersWorkload("count_up", "count_up: long-tailed answers, the 0.8M tiny base model", 5),
    "49m": PeersWorkload(
        "addition", "addition on the 49M engine-bench shape (hidden 512, 13 layers, MLP 1536, 8/4 heads; "
        "vocab: the task's 16 tokens, so 41M parameters)", 5, _49M,
        # a larger model: more KV, a gentler warm-up, and the time to reach the warm-up's target
        ("generator.inference_engine.kv_cache_memory_gib=0.5", "job.warmup_lr=3e-4", "job.warmup_steps=400",
         "job.warmup_target_accuracy=0.3", "job.warmup_max_seconds=1800")),
    "smollm2": PeersWorkload(
        None, "examples/smollm2's recipe: a real chat model as shipped (--model), LoRA, chat prompts asking "
        "for a sum, the last number in the response scored (gsm8k_flexible)",
        # float32 on both sides (TRL's trains in it): the recipe's bf16 null picks bfloat16 on AMX
        # / AVX-512-BF16
        5, overrides=("trainer.bf16=false",), recipe="examples/smollm2/config.yaml"),
}
REPOSITORY = Path(__file__).resolve().parents[2]
"""Where a workload's recipe path is relative to."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="inflight bench peers", description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default="default", choices=sorted(WORKLOADS),
                        help="default (addition), count_up (long-tailed answers), 49m (a larger model) or "
                             "smollm2 (a real chat model given by --model, examples/smollm2's recipe)")
    parser.add_argument(
        "--seconds",
        type=float,
        default=180.0,
        help="training time per run (default 180); with --steps only a cap, reported when it ends a run",
    )
    parser.add_argument(
        "--steps",
        type=positive_int,
        default=None,
        help="training steps per run: a budget in work, the same on a busy machine (default: none, "
        "each run trains for --seconds)",
    )
    parser.add_argument("--repeats", type=int, default=3, help="rounds of the sides, alternated (default 3)")
    parser.add_argument("--gains", default="10,25",
                        help="accuracy gains to time, in points over the start (default 10,25)")
    parser.add_argument("--eval-interval", type=int, default=None,
                        help="steps between held-out evaluations (default per workload)")
    parser.add_argument(
        "--sides", default=",".join(SIDES), help=f"which sides to run (default {','.join(SIDES)})"
    )
    parser.add_argument(
        "--model",
        default=None,
        help="a warmed-up model dir for the workload's task and shape (default: build + warm up); "
        "smollm2: the real model's HF dir, required, trained as shipped",
    )
    parser.add_argument("--trl-python", default=None,
                        help="TRL's interpreter (default: $INFLIGHT_TRL_PYTHON, else .venv-trl/bin/python)")
    parser.add_argument("--trl-threads", type=int, default=2, help="TRL's torch threads (default 2)")
    parser.add_argument("--pin", action=argparse.BooleanOptionalAction, default=False,
                        help="pin inflight's trainer and engine to separate cores as `bench rl` does "
                             "(default off, as `inflight train` runs)")
    parser.add_argument("--output-dir", default=None,
                        help="where results go (default runs/bench_peers/<workload>; the warmed-up model in "
                             "its base/base_model, for --model next time)")
    parser.add_argument("overrides", nargs="*", help="config overrides for every run (job.*, trainer.*, ...)")
    return parser


def _sides(text: str) -> list[str]:
    names = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [s for s in names if s not in SIDES]
    if unknown or not names:
        raise SystemExit(f"error: --sides {text!r}: choose among {', '.join(SIDES)}")
    return [s for s in SIDES if s in names]


def _gains(text: str) -> list[float]:
    try:
        gains = [float(g) for g in text.split(",") if g.strip()]
    except ValueError:
        gains = []
    if not gains or any(g <= 0 for g in gains):
        raise SystemExit(f"error: --gains {text!r}: give positive points, e.g. 10,25")
    return gains


def round_order(sides: list[str], rnd: int) -> list[str]:
    """The sides in round `rnd`'s order: rotated by one each round."""
    k = rnd % len(sides)
    return sides[k:] + sides[:k]


def eval_curve(records: list[dict[str, Any]]) -> list[list[float]]:
    """[time, accuracy] of every held-out evaluation in a run's records, in time order."""
    return sorted([r["time"], r["eval/accuracy"]] for r in records if r.get("eval/accuracy") is not None)


def final_evaluation_empty(records: list[dict[str, Any]]) -> bool:
    """Whether the run's last evaluation generated nothing at all (every data set's mean response
    length 0): seen when the fully-async trainer's last step started a background evaluation and
    the end of training aborted its requests; its accuracy is then not the model's."""
    evals = [r for r in records if r.get("eval/accuracy") is not None]
    lengths = [v for k, v in (evals[-1] if evals else {}).items() if k.endswith("/response_length")]
    return bool(lengths) and all(v == 0 for v in lengths)


def _eval_seconds(records: list[dict[str, Any]]) -> float | None:
    seconds = [r["eval/seconds"] for r in records if r.get("eval/seconds") is not None]
    return statistics.fmean(seconds) if seconds else None


def run_inflight(side: str, common: list[str], model: str, run_dir: Path, pin: bool,
                 base: str = "default") -> dict[str, Any]:
    """One `inflight train` run (`rl_bench.run_mode`) of config `base`, fully async when `side` is; its
    row."""
    from inflight.bench.rl_bench import run_mode
    from inflight.tracking.metrics import read_metrics

    row = run_mode(common, model, side == "fully_async", run_dir, 1.0, pin, base=base)
    records = read_metrics(run_dir / "metrics.jsonl")
    return {**row, "curve": eval_curve(records), "eval_seconds": _eval_seconds(records),
            "final_evaluation_empty": final_evaluation_empty(records),
            "steps": sum(1 for r in records if "reward" in r),  # the step records (evaluations may be apart)
            "cores_busy": row["own_cpu_s"] / max(row["wall_s"], 1e-9)}


def run_trl_side(common: list[str], model: str, run_dir: Path, seconds: float, python: str,
                 threads: int, base: str = "default", steps: int | None = None) -> dict[str, Any]:
    """One TRL run with the settings of the inflight run `common` would make from config `base`
    (`steps` training steps, `seconds` a cap; no `steps`: `seconds` of training); its row."""
    from inflight.bench.common import busy_cpu_seconds
    from inflight.bench.rl_bench import bench_config, make_bench_task
    from inflight.bench.trl_side import run_trl, trl_settings

    cfg, job = bench_config(
        [*common, f"trainer.policy.model.path={model}", f"job.output_dir={run_dir}"], base
    )
    task = make_bench_task(cfg, job)
    settings = trl_settings(cfg, task, model, run_dir, seconds, threads, max_steps=steps)
    busy = busy_cpu_seconds()
    summary = run_trl(python, settings, run_dir / "trl.log")
    other = max(0.0, busy_cpu_seconds() - busy - summary["cpu_s"])
    records = summary.pop("records")
    return {**summary, "curve": eval_curve(records), "eval_seconds": _eval_seconds(records),
            "steps_per_s": summary["steps"] / max(summary["train_seconds"], 1e-9),
            "cores_busy": summary["cpu_s"] / max(summary["wall_s"], 1e-9),
            "train_cores_busy": summary["train_cpu_s"] / max(summary["train_seconds"], 1e-9),
            "other_cpu_share": other / max(summary["wall_s"] * (os.cpu_count() or 1), 1e-9),
            "eval_problems": len(task.eval_problems()), "settings": settings}


def recipe_base(workload: PeersWorkload, model: str | None) -> str:
    """The config the workload's runs start from (`rl_bench.bench_config`'s `base`): the default job,
    or the recipe's file; SystemExit for a recipe without `--model` (a real model is not built here)."""
    if workload.recipe is None:
        return "default"
    if not model:
        raise SystemExit(
            f"error: this workload ({workload.recipe}) trains a real model as shipped, with no warm-up: "
            "give --model DIR, a Hugging Face model directory (`inflight models get "
            "smollm2-135m-instruct` writes SmolLM2-135M-Instruct's)"
        )
    return str(REPOSITORY / workload.recipe)


def check_recipe_run(cfg: Any, job: Any, name: str) -> None:
    """SystemExit naming every reason a run of workload `name`'s recipe would refuse to start (a model
    directory or data file missing, ...), before any run."""
    from inflight.train.main import describe_refusals, run_refusals

    problems = run_refusals(cfg, job)
    if problems:
        raise SystemExit(
            f"error: --workload {name}: {describe_refusals(problems)}\n(the recipe's data paths are "
            f"relative to the working directory: run from the repository root once the data is "
            f"written, as {WORKLOADS[name].recipe} says, or give data.train_data / data.val_data)"
        )


def _say_row(say, side: str, rnd: int, row: dict[str, Any]) -> None:
    evals = row["eval_seconds"]
    say(f"{side:>11} round {rnd}: {row['samples_per_s']:.0f} samples/s, accuracy {row['before']:.1%} -> "
        f"{row['after']:.1%}, {len(row['curve'])} evaluations"
        + (f" ({evals:.2f} s each)" if evals is not None else "")
        + f", cores busy {row['cores_busy']:.2f}, other processes {row['other_cpu_share']:.0%} of the CPUs")
    if row.get("final_evaluation_empty"):
        say(
            f"{side:>11} round {rnd}: WARNING: its final evaluation generated no tokens (requests aborted "
            "at the end of training): the accuracy after is not the model's"
        )


def main(argv: list[str] | None = None) -> int:
    from rich.console import Console

    from inflight.bench.peers_report import plot, summarize, table
    from inflight.bench.rl_bench import bench_config, make_bench_task, prepare_model, run_overrides
    from inflight.bench.trl_side import NOT_ALIGNED, default_python, hello, trainable_problem

    args = build_parser().parse_args(argv)
    sides, gains, workload = _sides(args.sides), _gains(args.gains), WORKLOADS[args.workload]
    if args.repeats < 1 or args.seconds <= 0:
        raise SystemExit("error: --repeats must be >= 1 and --seconds > 0")
    console = Console(soft_wrap=True)  # the table's rows stay whole lines

    def say(text: str) -> None:
        console.print(text, highlight=False)

    out = Path(args.output_dir or Path("runs/bench_peers") / args.workload)
    eval_interval = args.eval_interval or workload.eval_interval
    common = run_overrides(workload.task, args.seconds, eval_interval, [*workload.overrides, *args.overrides],
                           args.steps)
    base = recipe_base(workload, args.model)
    # its tokenizer makes the task
    real = [f"trainer.policy.model.path={args.model}"] if workload.recipe else []
    cfg, job = bench_config([*common, f"job.output_dir={out / 'base'}", *real], base)
    if workload.recipe:
        check_recipe_run(cfg, job, args.workload)
    python = args.trl_python or default_python()
    trl = hello(python) if "trl" in sides else None  # before the warm-up: a missing venv fails at once
    if trl is not None:
        say(f"TRL {trl['trl']} (transformers {trl['transformers']}, torch {trl['torch']}) from {python}")
        if args.model and (problem := trainable_problem(args.model)):
            raise SystemExit(f"error: --model {args.model}: {problem}")
    task = make_bench_task(cfg, job)
    model = args.model or prepare_model(cfg, job, task, say, shape=workload.shape)
    seeds = [cfg.trainer.seed + rnd for rnd in range(args.repeats)]
    results: dict[str, list[dict[str, Any]]] = {s: [] for s in sides}
    for rnd, seed in enumerate(seeds):
        for side in round_order(sides, rnd):
            run_common, run_dir = [*common, f"trainer.seed={seed}"], out / f"{side}-{rnd}"
            row = (
                run_trl_side(
                    run_common, model, run_dir, args.seconds, python, args.trl_threads, base, args.steps
                )
                if side == "trl"
                else run_inflight(side, run_common, model, run_dir, args.pin, base)
            )
            results[side].append(row)
            _say_row(say, side, rnd, row)
            say_time_capped(say, side, rnd, row, args.steps, args.seconds)
    describe = workload.describe + (f"; model {model}" if workload.recipe else "")
    result = {
        "args": vars(args),
        "workload": args.workload,
        "describe": describe,
        "task": task.name,
        "model": model,
        "cpu": cpu_name(),
        "seconds": args.seconds,
        "steps": args.steps,
        "repeats": args.repeats,
        "seeds": seeds,
        "gains": gains,
        "eval_interval": eval_interval,
        "eval_problems": len(task.eval_problems()),
        "trl": trl,
        "not_aligned": list(NOT_ALIGNED),
        "results": results,
        "summary": summarize(results, gains),
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_peers.json").write_text(json.dumps(result, indent=2))
    text = table(result)
    (out / "bench_peers.md").write_text(text)
    plot(result, out / "accuracy_vs_time.png")
    say(text)
    say(f"written: {out / 'bench_peers.json'}, {out / 'bench_peers.md'}, {out / 'accuracy_vs_time.png'}")
    return 0
