"""`inflight eval --model DIR --data FILE [--data FILE ...] [--output OUT] [options]`: N samples per
problem of each data set, scored by the data's rewards, summarised as pass@k.

Writes OUT/metrics.json (per data set, named by its file stem: num_problems, num_samples,
mean_reward, pass@1, pass@2, ..., pass@N, response_length, truncated_fraction; a sample is correct
when its reward is >= 1), OUT/samples.jsonl (one line per sample: data, problem_id, sample, prompt,
response, reward, ...) and OUT/eval_config.json (the resolved arguments). With the same --seed a
second run writes identical files. OUT is a directory of its own: a training run's outputs are
refused, and so are an earlier evaluation's files unless --overwrite.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from inflight.eval.job import DEFAULT_ENV_CLASS, EvalError, EvalSpec, run_job

DEFAULT_OUTPUT = "runs/inflight-eval"
"""Where results go without --output: not under a training run's output_dir (`runs/inflight` by default)."""
OUTPUT_FILES = ("metrics.json", "samples.jsonl", "eval_config.json")
"""What `inflight eval` writes in its --output directory."""


def build_parser(prog: str = "inflight eval") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True,
                   help="local Hugging Face model dir (with --server: the served model's, for its tokenizer)")
    p.add_argument("--data", action="append", required=True, metavar="FILE",
                   help="a .parquet, .jsonl / .json file or a datasets.save_to_disk dir (repeatable)")
    p.add_argument(
        "--output",
        default=DEFAULT_OUTPUT,
        metavar="OUT",
        help=f"directory for the results, new or an earlier inflight eval's (default {DEFAULT_OUTPUT}; "
        "never a training run's output_dir or its eval/ folder)",
    )
    p.add_argument(
        "--overwrite", action="store_true", help="replace the results of an earlier inflight eval in OUT"
    )
    p.add_argument("--n", type=int, default=1, help="samples per problem (default 1)")
    p.add_argument("--temperature", type=float, default=None,
                   help="sampling temperature (default: 0, greedy, for --n 1; 1.0 otherwise)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1, help="-1 or 0: off")
    p.add_argument("--seed", type=int, default=0,
                   help="run seed; each sample's seed derives from it and the problem (default 0)")
    p.add_argument("--max-tokens", type=int, default=1024,
                   help="most tokens generated per turn (default 1024; the context may end one sooner)")
    p.add_argument("--stop", action="append", default=[], metavar="STR",
                   help="stop string (repeatable); the reward sees the response up to the first one")
    p.add_argument("--include-stop-str-in-output", action="store_true",
                   help="the reward sees the stop string too (vLLM's flag)")
    p.add_argument("--max-turns", type=int, default=1,
                   help="model turns per episode for multi-turn environments that leave it to the run")
    p.add_argument("--reward-timeout-s", type=float, default=60.0,
                   help="a reward slower than this scores 0 (default 60; 0: no limit)")
    p.add_argument(
        "--env-class",
        default=DEFAULT_ENV_CLASS,
        metavar="NAME",
        help="reward / environment for rows without their own env_class, as environment.env_class "
        "in training: gsm8k, gsm8k_flexible, math, exact, contains, regex, a registered name or "
        f"package.module:name (default: {DEFAULT_ENV_CLASS}, training's)",
    )
    p.add_argument("--prompt-key", default=None,
                   help="column holding the prompt (default: prompt, or question)")
    p.add_argument("--answer-key", default=None,
                   help="column holding the ground truth (default: reward_spec or answer)")
    p.add_argument("--skyrl-gym", action="append", default=[], metavar="KEY=VALUE",
                   help="a setting of the skyrl-gym environments, as environment.skyrl_gym.KEY in training "
                        "(e.g. text2sql.db_path=/data/sql); repeat for several")
    p.add_argument("--max-problems", type=int, default=None,
                   help="evaluate only the first N problems of each set")
    p.add_argument("--server", action="append", default=[], metavar="URL",
                   help="evaluate through a running `inflight serve` (repeatable) instead of in process")
    p.add_argument("--api-key", default=None, help="the server's API key, if it has one")
    p.add_argument("--device", default="cpu", help="in process: torch device of the engine (default cpu)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    p.add_argument("--kv-cache-memory-gib", type=float, default=1.0)
    p.add_argument("--max-num-seqs", type=int, default=64, help="in process: requests run at once")
    p.add_argument("--concurrency", type=int, default=256, help="problems in flight at once (default 256)")
    p.add_argument("--threads", type=int, default=0, help="torch threads in process (0: torch's default)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Exit with a usage error naming every bad value."""
    problems = []
    for name, low in (("n", 1), ("max_tokens", 1), ("concurrency", 1), ("max_num_seqs", 1), ("max_turns", 1),
                      ("reward_timeout_s", 0)):
        if getattr(args, name) < low:
            problems.append(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= {low}")
    if args.temperature is not None and args.temperature < 0:
        problems.append(f"--temperature={args.temperature} must be >= 0 (0 is greedy)")
    if not 0 < args.top_p <= 1:
        problems.append(f"--top-p={args.top_p} must be in (0, 1]")
    if args.top_k < -1:
        problems.append(f"--top-k={args.top_k} must be >= -1 (-1 or 0 turns it off)")
    if args.max_problems is not None and args.max_problems < 1:
        problems.append(f"--max-problems={args.max_problems} must be >= 1")
    if args.n > 1 and args.temperature == 0:
        problems.append(f"--n {args.n} with --temperature 0 draws {args.n} identical greedy samples; "
                        "give a temperature > 0 (or --n 1)")
    missing = [d for d in args.data if not Path(d).exists()]
    if missing:
        problems.append(f"--data: no such file or directory: {', '.join(missing)}")
    if not (Path(args.model) / "config.json").is_file():
        problems.append(f"--model {args.model}: no config.json there (give a local Hugging Face model dir)")
    if (problem := output_problem(Path(args.output), args.overwrite)):
        problems.append(problem)
    if problems:
        p.error("; ".join(problems))


def output_problem(out: Path, overwrite: bool) -> str | None:
    """Why `inflight eval` must not write its files to `out`: a training run's outputs are there (its
    metrics.jsonl, or the step_<k>/ folders of its evaluations), or an earlier evaluation's files and
    not `overwrite`; None when it may."""
    if (out / "metrics.jsonl").exists() or any(out.glob("step_*")):
        return (
            f"--output {out} holds a training run's outputs (metrics.jsonl, or its evaluations' step_<k>/ "
            f"folders): give a directory of its own, e.g. --output {out.parent / (out.name + '-eval')}"
        )
    found = [name for name in OUTPUT_FILES if (out / name).exists()]
    if found and not overwrite:
        return (
            f"--output {out} already holds an evaluation ({', '.join(found)}): give another directory, or "
            "--overwrite to replace it"
        )
    return None


def spec_from_args(args: argparse.Namespace) -> EvalSpec:
    return EvalSpec(
        model=args.model, data=list(args.data), output=args.output, n=args.n, temperature=args.temperature,
        top_p=args.top_p, top_k=args.top_k, seed=args.seed, max_tokens=args.max_tokens, stop=list(args.stop),
        include_stop_str_in_output=args.include_stop_str_in_output, max_turns=args.max_turns,
        reward_timeout_s=args.reward_timeout_s or None,
        env_class=args.env_class, prompt_key=args.prompt_key, answer_key=args.answer_key,
        max_problems=args.max_problems, skyrl_gym=list(args.skyrl_gym),
        server=list(args.server), api_key=args.api_key, device=args.device, dtype=args.dtype,
        max_model_len=args.max_model_len, kv_cache_memory_gib=args.kv_cache_memory_gib,
        max_num_seqs=args.max_num_seqs, concurrency=args.concurrency,
    )


def main(argv: list[str] | None = None, prog: str = "inflight eval") -> int:
    """Entry point of `inflight eval`; returns the exit status."""
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    check_args(parser, args)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    from rich.console import Console

    from inflight.client.errors import ClientError
    from inflight.config import ConfigError
    from inflight.engine import EngineError
    from inflight.rewards import RewardError
    from inflight.tasks.dataset import DatasetError

    console = Console(soft_wrap=True)  # a line is a line, in a file too
    try:
        result = asyncio.run(run_job(spec_from_args(args), progress=not args.no_progress))
    except (ConfigError, DatasetError, RewardError, EvalError, EngineError, ClientError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    for name, m in result.metrics.items():
        ks = "  ".join(f"{k} {v:.1%}" for k, v in m.items() if k.startswith("pass@"))
        console.print(f"{name}: {int(m['num_problems'])} problems x {args.n}: {ks}  mean reward "
                      f"{m['mean_reward']:.3f}  response {m['response_length']:.0f} tokens "
                      f"({m['truncated_fraction']:.0%} truncated)", highlight=False)
    console.print(f"{len(result.samples)} samples in {result.seconds:.1f} s; results in {args.output}/ "
                  "(metrics.json, samples.jsonl, eval_config.json)", highlight=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
