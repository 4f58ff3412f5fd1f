"""`inflight bench train-step`: one optimizer step of a real model shape, per precision mode, beside a
plain `transformers` + `torch.optim.AdamW` loop doing the same step.

The model is random-init with a named shape (default Qwen2.5-0.5B's: hidden 896, 24 layers, 14 heads
/ 2 KV heads, MLP 4864, vocabulary 151936, tied embeddings), or the model in `--model-dir` (its own
shape, vocabulary and parameters: e.g. `inflight models get smollm2-135m-instruct`'s float32
directory); the batch is `--seqs` random sequences of `--len` tokens of its vocabulary, every token in
the loss. Each mode runs in its own fresh process, so its peak RSS is
its own: `fp32` (the policy worker as the trainer builds it), `bf16` (bfloat16 compute over float32
master weights), `bf16_gc` (plus activation checkpointing), `lora16` (a rank-16 `peft` adapter on
every linear layer, float32: only the adapter trains), `lora16_bf16` (the same adapter, float32,
over the frozen base held in bfloat16, compute under bf16 autocast), `lora16_bf16_gc` (plus
activation checkpointing), and `plain` (the baseline: the
same model, token-mean NLL over the full logits, gradient clipping and AdamW written straight against
transformers and torch). The worker modes run as the trainer builds them: log-probabilities in
chunks of `trainer.logprobs_chunk_size` tokens (default 1024; `--logprobs-chunk-size`), glibc's
malloc as glibc sets it.
A step is timed after `--warmup` untimed steps, on the wall clock and in CPU seconds (user +
system, steadier than the wall clock on a shared machine). Achieved FLOP/s counts the useful work, forward and
backward (3 x the forward's 2 FLOPs per parameter and token, plus the LM head and causal attention;
checkpointing's recomputed forward is not useful work), against the best matmul peak of that dtype
measured in the same process.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from inflight.bench.engine_workload import ModelShape

SHAPES: dict[str, dict[str, Any]] = {
    "qwen2.5-0.5b": dict(
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        vocab_size=151936,
        tie_word_embeddings=True,
    ),
    "small": dict(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=1024,
        tie_word_embeddings=True,
    ),
}
DEFAULT_SHAPE = "qwen2.5-0.5b"
MODES = ("plain", "fp32", "bf16", "bf16_gc", "lora16", "lora16_bf16", "lora16_bf16_gc")


def build_model(shape: str, out: Path) -> Path:
    """A random-init Qwen2 model of `shape` saved as a Hugging Face directory, unless `out` holds a
    model already."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    if (out / "config.json").is_file():
        return out
    torch.manual_seed(0)
    config = Qwen2Config(max_position_embeddings=4096, **SHAPES[shape])
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    return out


def _batch(vocab: int, seqs: int, length: int):
    import torch

    from inflight.train import TrainBatch

    ids = torch.randint(0, vocab, (seqs, length), generator=torch.Generator().manual_seed(0))
    loss_mask = torch.ones_like(ids)
    loss_mask[:, 0] = 0
    return TrainBatch(input_ids=ids, loss_mask=loss_mask)


def _plain_step(model_dir: Path, batch) -> Any:
    """The baseline: transformers forward, the same loss, backward, clip, AdamW."""
    import torch
    from transformers import AutoModelForCausalLM

    from inflight.train.losses import token_logprobs, token_mean_nll_loss

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, betas=(0.9, 0.999), weight_decay=0.01)

    def step() -> None:
        logits = model(input_ids=batch.input_ids).logits
        token_mean_nll_loss(token_logprobs(logits, batch.input_ids), batch).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def _worker_step(model_dir: Path, batch, mode: str, chunk: int | None = None) -> Any:
    from inflight.config import load_config
    from inflight.train import LocalPolicyWorker

    lora = (
        ["trainer.policy.model.lora.rank=16", "trainer.policy.model.lora.alpha=32"]
        if mode.startswith("lora")
        else []
    )
    chunking = [] if chunk is None else [f"trainer.logprobs_chunk_size={chunk}"]
    cfg = load_config(
        None,
        [
            f"trainer.policy.model.path={model_dir}",
            f"trainer.micro_train_batch_size_per_gpu={batch.input_ids.shape[0]}",
            *lora,
            *chunking,
        ],
    )
    worker = LocalPolicyWorker(cfg, bf16="bf16" in mode, gradient_checkpointing=mode.endswith("_gc"))
    worker.setup()
    return lambda: worker.train_step(batch)


def _useful_flops(shape: ModelShape, seqs: int, length: int) -> float:
    tokens = seqs * length
    width = shape.num_attention_heads * shape.head_dim
    attention = 4 * shape.num_hidden_layers * width * seqs * length * (length + 1) // 2  # QK^T and AV, causal
    head = 2.0 * shape.hidden_size * shape.vocab_size * tokens
    return 3.0 * (2.0 * shape.trunk_matmul_params() * tokens + head + attention)


def describe_model(model_dir: Path) -> dict[str, Any]:
    """What the table and the JSON say of the model: its directory, type, shape and parameter count
    (from the safetensors headers: a tied LM head counts once)."""
    from inflight.orchestration.engine_memory import parameter_count

    params = parameter_count(model_dir) or 0
    model_type = json.loads((model_dir / "config.json").read_text()).get("model_type", "?")
    return {"path": str(model_dir), "model_type": model_type, "params": params,
            "shape": asdict(ModelShape.from_model_dir(model_dir))}


def _cpu_seconds() -> float:
    """This process's user + system CPU time: on a shared machine, steadier than the wall clock."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def run_mode(mode: str, model_dir: Path, seqs: int, length: int, warmup: int, threads: int,
             chunk: int | None = None) -> dict:
    """One mode's measurements, in this process (the parent runs each mode in a fresh one)."""
    import torch

    from inflight.bench.common import matmul_peak_flops, peak_rss_mib

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model_shape = ModelShape.from_model_dir(model_dir)
    batch = _batch(model_shape.vocab_size, seqs, length)
    step = _plain_step(model_dir, batch) if mode == "plain" else _worker_step(model_dir, batch, mode, chunk)
    for _ in range(warmup):
        step()
    started, cpu_started = time.perf_counter(), _cpu_seconds()
    step()
    seconds, cpu_seconds = time.perf_counter() - started, _cpu_seconds() - cpu_started
    peak = matmul_peak_flops(torch.bfloat16 if "bf16" in mode else torch.float32)
    flops = _useful_flops(model_shape, seqs, length)
    return {"mode": mode, "seconds_per_step": seconds, "cpu_seconds_per_step": cpu_seconds,
            "tokens_per_s": seqs * length / seconds,
            "peak_rss_mib": peak_rss_mib(), "flops_per_s": flops / seconds, "matmul_peak_flops": peak,
            "fraction_of_peak": flops / seconds / peak}


def _child(args: argparse.Namespace) -> int:
    result = run_mode(args.child, Path(args.model_dir), args.seqs, args.len, args.warmup, args.threads,
                      args.logprobs_chunk_size)
    print("RESULT " + json.dumps(result))
    return 0


def _run_child(mode: str, args: argparse.Namespace, model_dir: Path) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "inflight.bench.train_step_bench",
        "--child",
        mode,
        "--model-dir",
        str(model_dir),
        "--seqs",
        str(args.seqs),
        "--len",
        str(args.len),
        "--warmup",
        str(args.warmup),
        "--threads",
        str(args.threads),
        *(
            []
            if args.logprobs_chunk_size is None
            else ["--logprobs-chunk-size", str(args.logprobs_chunk_size)]
        ),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"mode {mode} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(lines[-1].removeprefix("RESULT "))


def format_table(results: list[dict], cpu: str, model: dict[str, Any]) -> str:
    plain = next((r for r in results if r["mode"] == "plain"), None)
    shape = model["shape"]
    lines = [
        f"train step on {cpu}",
        f"model: {model['model_type']} ({model['path']}), hidden {shape['hidden_size']}, "
        f"{shape['num_hidden_layers']} layers, vocab {shape['vocab_size']}, "
        f"{model['params'] / 1e6:.1f}M params",
        "| mode | s/step | CPU s/step | tokens/s | peak RSS (MiB) | vs plain time | "
        "vs plain CPU time | vs fp32 memory | FLOP/s | of matmul peak |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    fp32 = next((r for r in results if r["mode"] == "fp32"), None)
    for r in results:
        vs_time = f"{r['seconds_per_step'] / plain['seconds_per_step']:.2f}x" if plain else "-"
        vs_cpu = f"{r['cpu_seconds_per_step'] / plain['cpu_seconds_per_step']:.2f}x" if plain else "-"
        vs_mem = f"{r['peak_rss_mib'] / fp32['peak_rss_mib']:.0%}" if fp32 else "-"
        lines.append(
            f"| {r['mode']} | {r['seconds_per_step']:.2f} | {r['cpu_seconds_per_step']:.2f} | "
            f"{r['tokens_per_s']:.0f} | {r['peak_rss_mib']:.0f} | {vs_time} | {vs_cpu} | {vs_mem} | "
            f"{r['flops_per_s'] / 1e9:.1f} G | {r['fraction_of_peak']:.0%} |"
        )
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="inflight bench train-step", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES),
                        help="shape of the random model built here (default qwen2.5-0.5b)")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    parser.add_argument("--seqs", type=int, default=8)
    parser.add_argument("--len", type=int, default=512)
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps before the timed one")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--logprobs-chunk-size",
        type=int,
        help="trainer.logprobs_chunk_size for the worker modes (default: the key's default, 1024)",
    )
    parser.add_argument(
        "--model-dir",
        help="train the model in this HF directory (its own shape and vocabulary); "
        "an empty or new one gets the --shape model built there",
    )
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.child:
        return _child(args)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        print(f"error: unknown mode(s) {unknown}; use any of {list(MODES)}", file=sys.stderr)
        return 2
    if args.model_dir and (Path(args.model_dir) / "config.json").is_file() and args.shape:
        print(f"error: --shape picks the random model built here; --model-dir {args.model_dir} holds a model "
              "already, whose own shape is measured: drop --shape", file=sys.stderr)
        return 2
    from inflight.engine.cpu import best_isa_level, cpu_family_model, cpu_model

    cpu = f"{cpu_model()} ({cpu_family_model()}, kernels {best_isa_level()}), {args.threads} threads"
    with tempfile.TemporaryDirectory(prefix="inflight-train-step-") as tmp:
        model_dir = Path(args.model_dir or tmp)
        built = not (model_dir / "config.json").is_file()
        model = describe_model(build_model(args.shape or DEFAULT_SHAPE, model_dir))
        results = [_run_child(mode, args, model_dir) for mode in modes]
    if built:
        where = "in " + args.model_dir if args.model_dir else "here"
        model["path"] = f"random {args.shape or DEFAULT_SHAPE}, built {where}"
    print(format_table(results, cpu, model))
    if args.json:
        Path(args.json).write_text(
            json.dumps({"cpu": cpu, "args": vars(args), "model": model, "results": results}, indent=2)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
