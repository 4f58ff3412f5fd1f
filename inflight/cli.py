"""The `inflight` command line: train | eval | generate | serve | bench | models | env."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

DEFAULT_PROMPTS = ["the water is", "12+34=", "what is the way to make a good day"]


def default_model_dir() -> Path:
    """A small Qwen2-shaped random model built locally once (no downloads)."""
    from inflight.models_hub import cache_root
    from inflight.testing import make_tiny_model

    path = cache_root() / "models" / "demo-qwen2-h256-l4"
    if not (path / "model.safetensors").is_file():
        print(f"building a random demo model in {path} ...", flush=True)
        make_tiny_model(path, "qwen2", seed=0, hidden_size=256, intermediate_size=768,
                        num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4)
    return path


def cmd_generate(args: argparse.Namespace) -> int:
    import torch
    from transformers import AutoTokenizer

    from inflight.engine import EngineConfig, EngineError, LLMEngine, SamplingParams

    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = Path(args.model) if args.model else default_model_dir()
    try:
        engine = LLMEngine(EngineConfig(model=str(model_dir), device=args.device, dtype=args.dtype))
    except EngineError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = args.prompt or DEFAULT_PROMPTS
    if args.chat:
        ids = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)
               for p in prompts]
        ids = [list(x["input_ids"]) if isinstance(x, dict) or hasattr(x, "keys") else list(x) for x in ids]
    else:
        ids = [tokenizer(p)["input_ids"] for p in prompts]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed, ignore_eos=args.ignore_eos)
    start = time.perf_counter()
    try:
        outputs = engine.generate(ids, params)
    except EngineError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    elapsed = time.perf_counter() - start
    total = 0
    for prompt, out in zip(prompts, outputs, strict=True):
        total += len(out.output_token_ids)
        text = tokenizer.decode(out.output_token_ids, skip_special_tokens=False)
        print(f"--- prompt: {prompt!r}\n{text!r}\n[{len(out.output_token_ids)} tokens, "
              f"finish_reason={out.finish_reason}]")
    print(f"{total} tokens in {elapsed:.2f} s: {total / elapsed:.1f} tokens/s")
    return 0


BENCHMARKS = "engine | weight-sync | serve | rl | peers | train-step"


def cmd_bench(args: argparse.Namespace, rest: list[str]) -> int:
    if args.what is None:
        print(f"usage: inflight bench {{{BENCHMARKS.replace(' | ', ',')}}} [options]; "
              "`inflight bench X --help` lists benchmark X's options")
        return 0 if {"-h", "--help"} & set(rest) else 2
    if args.what == "engine":
        from inflight.bench.engine_bench import main as bench_main
    elif args.what == "weight-sync" and any(a.startswith("--server") for a in rest):
        from inflight.bench.server_sync_bench import main as bench_main  # pause for an update into a server
    elif args.what == "weight-sync" and any(a.startswith("--transport") for a in rest):
        from inflight.bench.transport_bench import main as bench_main  # bytes/s per transport
    elif args.what == "weight-sync":
        from inflight.bench.weight_sync_bench import main as bench_main  # pause per KV fate
    elif args.what == "serve":
        from inflight.bench.serve_bench import main as bench_main
    elif args.what == "rl":
        from inflight.bench.rl_bench import main as bench_main
    elif args.what == "peers":
        from inflight.bench.peers_bench import main as bench_main  # TRL's GRPOTrainer against ours
    elif args.what == "train-step":
        from inflight.bench.train_step_bench import main as bench_main
    else:
        print(f"error: unknown benchmark {args.what!r}; available: {BENCHMARKS}", file=sys.stderr)
        return 2
    return bench_main(rest)


async def _start_ray(*args, **kwargs):
    """`inflight.cluster.start_ray`, imported on use: only `--ray` runs need Ray installed."""
    from inflight.cluster import start_ray

    return await start_ray(*args, **kwargs)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="inflight", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text with the native engine")
    gen.add_argument("--model", help="local Hugging Face model dir (default: a random demo model built here)")
    gen.add_argument("--prompt", action="append", help="prompt text (repeatable)")
    gen.add_argument("--chat", action="store_true", help="wrap prompts in the tokenizer's chat template")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--device", default="cpu")
    gen.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    gen.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    sub.add_parser("train", add_help=False, help="fully-async GRPO (see inflight train --help)")
    sub.add_parser("eval", add_help=False, help="pass@k of a model on data files (see inflight eval --help)")
    sub.add_parser(
        "serve", add_help=False, help="run the OpenAI-compatible server (see inflight serve --help)"
    )
    # no help of its own: `inflight bench X --help` must reach benchmark X's parser
    bench = sub.add_parser(
        "bench", add_help=False, help=f"run a benchmark ({BENCHMARKS}); options after it go to the benchmark"
    )
    bench.add_argument("what", nargs="?", help=BENCHMARKS)
    sub.add_parser("models", add_help=False,
                   help="get a real model as a checked HF directory (see inflight models --help)")
    env = sub.add_parser("env", help="what a bug report needs: CPU, kernel ISA, backends, versions")
    env.add_argument("--json", action="store_true", help="one JSON object instead of text")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if args.command == "bench":
        return cmd_bench(args, rest)
    if args.command == "train":
        from inflight.train.main import main as train_main

        return train_main(rest, start_ray=_start_ray)
    if args.command == "eval":
        from inflight.eval.cli import main as eval_main

        return eval_main(rest, prog="inflight eval")
    if args.command == "serve":
        from inflight.server.main import main as serve_main

        return serve_main(rest, prog="inflight serve")
    if args.command == "models":
        from inflight.models_hub.cli import main as models_main

        return models_main(rest, prog="inflight models")
    if args.command == "env":
        from inflight.env_report import main as env_main

        return env_main(["--json"] if args.json else [])
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    return cmd_generate(args)


if __name__ == "__main__":
    sys.exit(main())
