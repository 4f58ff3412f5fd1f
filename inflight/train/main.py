"""`inflight train [--config YAML] [key=value ...]`: evaluate, RL, evaluate.

`inflight train key=value ...` means what SkyRL's entry point means: every key not given takes
SkyRL's default (`inflight.config.schema`), the run lasts `trainer.epochs` over the data (at most
`trainer.max_training_steps` steps), and it resumes as `trainer.resume_mode` says. `--config YAML` starts
from a file instead (`base: demo` in it: from the built-in demo). The demo
(`--config examples/default.yaml`, what `scripts/run.sh` runs) builds a tiny base model and a
character tokenizer, warms the model up with a short supervised phase, prints its greedy accuracy on
200 held-out problems, runs fully-async GRPO with in-flight weight updates, and prints the accuracy
after. Overrides use dotted keys of the schema (`trainer.fully_async.enabled=true`) or of the
`job:` section (`job.max_train_seconds=60`).

This module does not know Ray: with `--ray` (`job.ray`) the run starts on the runtime that the
caller passes as `start_ray` (the `inflight` command passes `inflight.cluster.start_ray`).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from inflight.backends.registry import backend_of
from inflight.config import Config, ConfigError, Violation, config_from_dict, dump_config
from inflight.config.implemented import unimplemented
from inflight.config.job import JobConfig, split_job_config
from inflight.config.loader import read_yaml
from inflight.train.data_setup import check_data_job, make_data_task, uses_data
from inflight.train.defaults import default_job

if TYPE_CHECKING:
    from inflight.train.runtime import Starter


def build_parser(prog: str = "inflight train") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=None,
                        help="YAML config (default: none, SkyRL's defaults; the demo: examples/default.yaml)")
    parser.add_argument("--print-config", action="store_true",
                        help="print the resolved config and exit: 0, or 2 listing every reason a run would "
                             "refuse it")
    parser.add_argument(
        "--reference",
        action="store_true",
        help="print the configuration reference (every key: default, status, meaning) and exit",
    )
    parser.add_argument(
        "--ray", action="store_true", help="run the engines and the policy ranks as Ray actors"
    )
    parser.add_argument("--ray-address", default=None, help="join this Ray cluster (implies --ray)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.epochs=2")
    return parser


def resolve_config(config_path: str | None, overrides: list[str]) -> tuple[Config, JobConfig]:
    """The run's settings: the YAML at `config_path` (or SkyRL's defaults), then `overrides`. A YAML
    with `base: demo` (or `base: other.yaml`, relative to it) holds only what differs from that base:
    its mappings are merged over the base's, key by key. What a run would refuse is not checked here
    (`inflight.config.implemented.require_implemented`)."""
    data = with_base(read_yaml(config_path), Path(config_path)) if config_path else {}
    try:
        job, rest, other = split_job_config(data, overrides)
    except ConfigError as err:  # list the schema's violations too, not only the job section's
        raise ConfigError([*err.violations, *_schema_violations(data, overrides)]) from None
    if job.ray_address:
        job.ray = True
    return config_from_dict(rest, other), job


def config_reference() -> str:
    """The configuration reference page (`docs/reference/config.md`): the schema's keys, then `job:`'s."""
    from inflight.config.reference import dataclass_rows, render

    return render(dataclass_rows(JobConfig, "job."))


def missing_devices(cfg: Config, job: JobConfig) -> str | None:
    """Why the run cannot have the CUDA devices it names (a CPU-only torch, no GPU, or fewer GPUs
    than the GPU-count keys ask of this node: `device_counts.too_many_gpus`), or None; checked
    before anything is built, so the run stops at once with the key, not 20 s in."""
    wanted = {
        key: value
        for key, value in (
            ("generator.inference_engine.device", cfg.generator.inference_engine.device),
            ("job.trainer_device", job.trainer_device),
        )
        if value.startswith("cuda")
    }
    if not wanted:
        return None
    import torch

    if torch.cuda.is_available():
        from inflight.orchestration.device_counts import too_many_gpus

        return too_many_gpus(cfg, job)
    build = "a CPU-only build" if torch.version.cuda is None else "built with CUDA but sees no GPU"
    keys = ", ".join(f"{k}={v}" for k, v in wanted.items())
    return f"{keys}: this torch ({torch.__version__}) is {build}; use cpu, or a CUDA torch on a GPU machine"


def run_refusals(cfg: Config, job: JobConfig, start_ray: Starter | None = None) -> list[object]:
    """Every reason a run of `cfg` and `job` would refuse to start, found before anything is built
    (what `--print-config` lists, and what a run stops on at once): keys set to what is not
    implemented here, the data job's contradictions, CUDA devices this machine lacks, a missing
    vLLM or verifiers venv, what vLLM cannot serve (`backends.vllm.run_checks`), and `job.ray` without
    its runtime. Imports no torch for a CPU config."""
    from inflight.rewards.hubs import hub_problem

    problems: list[object] = list(unimplemented(cfg))
    try:
        check_data_job(cfg, job)
    except ConfigError as err:
        problems += err.violations
    problems += missing_files(cfg, job)
    # e.g. vLLM's python, the model's shape on its kernels, logprobs mode
    problems += backend_of(cfg).problems(cfg)
    problems += filter(None, [hub_problem(cfg)])  # what environment.env_class's hub needs installed
    problems += filter(None, [missing_devices(cfg, job)])
    if job.ray and start_ray is None:
        problems.append("job.ray=true needs the `inflight` command (`inflight train --ray`)")
    return problems


def missing_files(cfg: Config, job: JobConfig) -> list[Violation]:
    """The model directory and data files a run reads first thing that are not there, one violation each."""
    model = cfg.trainer.policy.model.path
    out = []
    if model is not None and not (Path(model) / "config.json").is_file():
        out.append(
            Violation(
                "trainer.policy.model.path",
                model,
                "has no config.json (it must be a local Hugging Face model directory)",
                "give the directory of a Qwen2, Qwen3 or Llama checkpoint",
            )
        )
    if not uses_data(cfg, job):
        return out
    old_spelling = job.task == "jsonl" and bool(job.train_data)
    keys = (
        (("job.train_data", [job.train_data]), ("job.eval_data", [job.eval_data] if job.eval_data else []))
        if old_spelling
        else (("data.train_data", cfg.data.train_data), ("data.val_data", cfg.data.val_data))
    )
    return out + [
        Violation(
            key,
            path,
            "does not exist",
            f"give {key} your data files (.parquet, .jsonl / .json, or a datasets.save_to_disk directory)",
        )
        for key, paths in keys
        for path in paths
        if path.strip() and not Path(path).exists()
    ]


def describe_refusals(problems: list[object]) -> str:
    """`problems` (`run_refusals`) as one message, one line each."""
    n = len(problems)
    return f"a run would refuse this config ({n} reason{'s' if n != 1 else ''}):\n" + "\n".join(
        f"  - {p}" for p in problems)


def _schema_violations(data: dict[str, Any], overrides: list[str]) -> list[Violation]:
    """What the schema says of `data` and `overrides` without their `job` parts."""
    rest = {k: v for k, v in data.items() if k != "job" and not str(k).startswith("job.")}
    other = [o for o in overrides if not o.strip().lstrip("+").startswith("job.")]
    try:
        config_from_dict(rest, other)
    except ConfigError as err:
        return err.violations
    return []


def with_base(data: dict[str, Any], path: Path) -> dict[str, Any]:
    """`data` merged over the config its `base:` names (`default`: the built-in default job)."""
    base = data.pop("base", None)
    if base is None:
        return data
    if base in ("demo", "default"):
        parent = default_job()
    else:
        base_path = (path.parent / str(base)).resolve()
        parent = with_base(read_yaml(base_path), base_path)
    return _merged(parent, data)


def _merged(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        out[key] = (
            _merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
        )
    return out


def make_task(cfg: Config, job: JobConfig):
    """The run's task: the data task for `data.train_data` (or `job.task=jsonl`), else the built-in
    `job.task`. Raises ConfigError, DatasetError or RewardError before anything runs."""
    from inflight.tasks.registry import make_builtin_task

    check_data_job(cfg, job)
    if uses_data(cfg, job):
        return make_data_task(cfg, job)
    tokenizer = None
    if cfg.trainer.policy.model.path is not None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(cfg.trainer.policy.model.path,
                                                  use_fast=not cfg.trainer.disable_fast_tokenizer)
    return make_builtin_task(job.task, tokenizer, num_train=job.num_train, num_eval=job.num_eval,
                             seed=cfg.trainer.seed)


def eval_label(cfg: Config) -> str:
    """What the evaluation measures: greedy accuracy (temperature 0, one sample) or pass@1."""
    n, temperature = cfg.generator.eval_n_samples_per_prompt, cfg.generator.eval_sampling_params.temperature
    if temperature == 0 and n == 1:
        return "greedy accuracy"
    return f"pass@1 (n={n}, temperature {temperature:g})"


def describe_eval(result: dict[str, Any]) -> str:
    """`74.0% (200 held-out problems)`, with each data set's share when there are several."""
    sets = result["datasets"]
    total = sum(int(m["num_problems"]) for m in sets.values())
    text = f"{result['accuracy']:.1%} ({total} held-out problems"
    if len(sets) > 1:
        text += ": " + ", ".join(f"{name} {m['pass@1']:.1%}" for name, m in sets.items())
    return text + ")"


def prepare_base_model(cfg: Config, job: JobConfig, task, say) -> dict[str, Any]:
    """Build and warm up the tiny base model when no model path is given; sets the path."""
    from inflight.tasks import build_base_model, warm_up

    path = Path(job.base_model_dir or Path(job.output_dir) / "base_model")
    say(f"building the tiny base model ({job.arch}) in {path} and warming it up ({warmup_plan(job)})")
    build_base_model(path, seed=cfg.trainer.seed, tokenizer=task.tokenizer, arch=job.arch)
    report = warm_up(path, task, steps=job.warmup_steps, batch_size=job.warmup_batch_size, lr=job.warmup_lr,
                     max_seconds=job.warmup_max_seconds, target_accuracy=job.warmup_target_accuracy,
                     seed=cfg.trainer.seed, log=say, threads=job.warmup_threads)
    cfg.trainer.policy.model.path = str(path)
    say(warmup_outcome(report))
    return {"steps": report.steps, "seconds": report.seconds, "accuracy": report.accuracy,
            "stopped_by": report.stopped_by}


def warmup_plan(job: JobConfig) -> str:
    """The warm-up's budget as a run announces it: its steps, its early stop, its time cap."""
    text = f"supervised, {job.warmup_steps} steps"
    if job.warmup_target_accuracy is not None:
        text += f" or until {job.warmup_target_accuracy:.0%} accuracy"
    return text + (f", capped at {job.warmup_max_seconds:g} s" if job.warmup_max_seconds is not None else "")


def warmup_outcome(report) -> str:
    """The line a run says after the warm-up (`inflight.tasks.WarmupReport`); when the time cap
    ended it, what to change so that the next run does all of its steps."""
    text = (f"warm-up: {report.steps} steps in {report.seconds:.0f} s, accuracy {report.accuracy:.1%} "
            f"(stopped by {report.stopped_by})")
    if report.stopped_by == "time":
        text += (
            f"; job.warmup_max_seconds ended it before its job.warmup_steps={report.steps_asked}: RL starts "
            "from a less trained model than on a faster machine; raise the cap (or set it to null)"
        )
    return text


async def run_job(cfg: Config, job: JobConfig, task, say, start: Starter | None = None) -> dict[str, Any]:
    """Evaluate, train and evaluate on the runtime `start` starts (default: `start_local`); the
    run's summary."""
    import torch

    from inflight.tracking.metrics import plot_metrics
    from inflight.train.runtime import start_local
    from inflight.train.trainer import make_trainer
    from inflight.train.workers.local import describe_precision

    say(describe_precision(cfg, torch.device(job.trainer_device)))
    trainer = make_trainer(cfg, job, task, start=start or start_local)
    summary: dict[str, Any] = {"mode": trainer.mode}
    try:
        await trainer.setup()
        if trainer.resumed_from is not None:
            say(f"resumed from {trainer.resumed_from} (step {trainer.global_step})")
        evaluating = cfg.trainer.eval_interval > 0
        before = await trainer.evaluate() if evaluating and cfg.trainer.eval_before_train else None
        if before is not None:
            say(f"{eval_label(cfg)} before RL: {describe_eval(before)}")
            trainer.logger.log(trainer.global_step, {"time": 0.0, **before["metrics"]})
        started = time.perf_counter()
        history = await trainer.train()
        train_s = time.perf_counter() - started
        after = await trainer.evaluate() if evaluating else None
        if after is not None and trainer.logged_evaluation != after["step"]:  # the loop logged it
            trainer.logger.log(trainer.global_step, {"time": train_s, **after["metrics"]})
        samples = sum(r.get("samples", 0) for r in history)
        summary.update(
            before=before and before["accuracy"],
            after=after and after["accuracy"],
            eval={"before": before and before["datasets"], "after": after and after["datasets"]},
            eval_label=eval_label(cfg),
            steps=trainer.global_step,
            train_seconds=train_s,
            samples=samples,
            samples_per_s=samples / max(train_s, 1e-9),
            time_capped=trainer.time_capped,
        )
        if trainer.time_capped:
            say(
                f"RL stopped by its time cap, job.max_train_seconds={job.max_train_seconds:g}, after step "
                f"{trainer.global_step} of {trainer.training_steps}: the result depends on this machine's "
                "speed and load; raise the cap (or set it to null) to run every step"
            )
    finally:
        await trainer.close()
    out = Path(job.output_dir)
    if job.plot and (out / "metrics.jsonl").is_file() and history:
        summary["plot"] = str(plot_metrics(out / "metrics.jsonl", out / "reward_staleness.png",
                                           f"{trainer.mode} GRPO on {task.name}"))
    return summary


def _error(problem: object, status: int = 2) -> int:
    print(f"error: {problem}", file=sys.stderr)
    return status


def main(argv: list[str] | None = None, start_ray: Starter | None = None) -> int:
    """Entry point of `inflight train`; returns the exit status. `start_ray`: the runtime for
    `--ray` (`job.ray`), which only the `inflight` command supplies."""
    args = build_parser().parse_intermixed_args(argv)  # options may sit among the overrides
    if args.reference:
        sys.stdout.write(config_reference())
        return 0
    overrides = list(args.overrides)
    if args.ray or args.ray_address:
        overrides.append("job.ray=true")
    if args.ray_address:
        overrides.append(f"job.ray_address={args.ray_address}")
    try:
        cfg, job = resolve_config(args.config, overrides)
    except ConfigError as err:
        return _error(err)
    except OSError as err:  # --config names a file that is missing or unreadable
        reason = (
            "does not exist" if isinstance(err, FileNotFoundError) else f"cannot be read ({err.strerror})"
        )
        return _error(f"--config {args.config}: the config file {reason}")
    refusals = run_refusals(cfg, job, start_ray)
    if args.print_config:
        print(
            dump_config(cfg) + "job:\n" + "".join(f"  {k}: {json.dumps(v)}\n" for k, v in vars(job).items())
        )
    if refusals:
        return _error(describe_refusals(refusals))
    if args.print_config:
        return 0
    from rich.console import Console

    say = functools.partial(Console(soft_wrap=True).print, highlight=False)  # a line is a line, in a file too
    from inflight.rewards import RewardError
    from inflight.tasks.dataset import DatasetError

    started = time.perf_counter()
    try:
        task = make_task(cfg, job)
    except (ConfigError, DatasetError, RewardError) as err:
        return _error(err)
    if getattr(task, "report", None) is not None:
        say(task.report.summary())
    from inflight.train.checkpoint import resume_problem

    try:  # a checkpoint of another run's data: refused before any model is built
        if (problem := resume_problem(cfg.trainer, task.train_problems())) is not None:
            return _error(problem)
    except ConfigError as err:
        return _error(err)
    warm = None
    if cfg.trainer.policy.model.path is None:
        warm = prepare_base_model(cfg, job, task, say)
    from inflight.agents.agent import AgentError
    from inflight.client.process import EngineProcessError
    from inflight.orchestration.engine_restarts import EngineDiedError
    from inflight.train.data_setup import NothingGeneratedError

    try:
        summary = asyncio.run(run_job(cfg, job, task, say, start_ray if job.ray else None))
    except (NothingGeneratedError, EngineDiedError, EngineProcessError, AgentError) as err:
        return _error(err, 1)  # the message names what failed and what to do
    summary["total_seconds"] = time.perf_counter() - started
    if warm is not None:
        summary["warmup"] = warm
    if getattr(task, "report", None) is not None:
        summary["data"] = task.report.as_dict()
    Path(job.output_dir).mkdir(parents=True, exist_ok=True)
    (Path(job.output_dir) / "summary.json").write_text(json.dumps(summary, indent=2))
    if summary["after"] is None:
        result = f"no evaluation (trainer.eval_interval={cfg.trainer.eval_interval})"
    else:
        before = "not evaluated" if summary["before"] is None else f"{summary['before']:.1%}"
        result = f"{summary['eval_label']} after RL: {summary['after']:.1%} (before: {before})"
    say(f"{result}; {summary['steps']} {summary['mode']} steps in {summary['train_seconds']:.0f} s "
        f"({summary['samples_per_s']:.0f} samples/s); total {summary['total_seconds']:.0f} s")
    from inflight.tracking.run_logs import where_logged

    say(where_logged(cfg, job, summary.get("plot")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
