"""`inflight bench weight-sync`: how long generation is paused for an in-process weight update.

For a ~50M-parameter Qwen2-shaped model with N requests in flight (mid-decode), each KV fate is
timed from pause() to resume() returning, beside a memcpy of the same bytes measured in the same
run; then the cost of getting back to decoding after the resume (the re-prefill of `recompute`
versus the restore of `offload`) in seconds and recomputed tokens.

`--lora R`: each sync sends a rank-R LoRA adapter on every linear layer (what a LoRA policy's
in-flight sync sends) instead of the model, and the engine merges it into its base weights; the
table says how many bytes moved against a full sync's (keep and recompute: offload's sleep drops
the base an adapter needs).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from inflight.bench.common import MODEL_SHAPES
from inflight.engine import EngineConfig, LLMEngine, SamplingParams
from inflight.engine.models.loader import iter_safetensors
from inflight.testing import make_tiny_model

FATES = ("keep", "offload", "recompute")


def memcpy_seconds(tensors: list[torch.Tensor], repeats: int = 5) -> float:
    """Best time to copy these tensors into preallocated buffers of the same shapes."""
    dests = [torch.empty_like(t) for t in tensors]
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for dst, src in zip(dests, tensors, strict=True):
            dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return best


def _start_requests(engine: LLMEngine, num_requests: int, prompt_len: int, warm_steps: int) -> None:
    rng = random.Random(0)
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    for i in range(num_requests):
        engine.add_request(f"r{i}", [rng.randrange(3, 500) for _ in range(prompt_len)], params)
    for _ in range(warm_steps):
        engine.step()


def sync_once(engine: LLMEngine, fate: str, weights: list[tuple[str, torch.Tensor]], version: int) -> float:
    """One in-process update with the given KV fate; returns seconds generation was paused."""
    start = time.perf_counter()
    engine.pause("keep")
    if fate == "offload":
        engine.sleep(offload_kv=True)
        engine.wake_up(["weights"])
    engine.begin_weight_update()
    engine.load_weights(weights)
    engine.finish_weight_update(version)
    if fate == "offload":
        engine.wake_up(["kv_cache"])
    if fate == "recompute":
        engine.reset_prefix_cache(reset_running_requests=True)
    engine.resume()
    return time.perf_counter() - start


def _catch_up(engine: LLMEngine) -> tuple[float, int]:
    """Step until every request decodes again; returns (seconds, recomputed tokens)."""
    before = engine.stats.recomputed_tokens
    start = time.perf_counter()
    while any(r.num_computed_tokens < r.num_tokens - 1 for r in engine.scheduler.unfinished()):
        engine.step()
    return time.perf_counter() - start, engine.stats.recomputed_tokens - before


def adapter_weights(model_dir: str, rank: int) -> list[tuple[str, torch.Tensor]]:
    """A rank-`rank` peft LoRA adapter on every linear layer of the model, with random B (peft
    starts B at 0), as a LoRA policy's sync sends it (`inflight.train.lora.adapter_tensors`)."""
    from transformers import AutoModelForCausalLM

    from inflight.config import load_config
    from inflight.train.lora import adapter_tensors, apply_lora

    cfg = load_config(
        None, [f"trainer.policy.model.lora.rank={rank}", f"trainer.policy.model.lora.alpha={2 * rank}"]
    )
    model = apply_lora(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), cfg)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_B." in name:
                param.normal_(0, 0.01)
    return [(name, tensor.clone()) for name, tensor in adapter_tensors(model)]


def run(model_dir: str, num_requests: int, prompt_len: int, repeats: int, lora: int = 0) -> dict:
    engine = LLMEngine(EngineConfig(model=model_dir, max_num_batched_tokens=4096))
    full = [(name, tensor.clone()) for name, tensor in iter_safetensors(model_dir)]  # off the mmap
    weights = adapter_weights(model_dir, lora) if lora else full
    nbytes = sum(t.nbytes for _, t in full)
    copy_s = memcpy_seconds([t for _, t in full])
    sent = sum(t.nbytes for _, t in weights)
    results: dict = {"weight_bytes": nbytes, "memcpy_s": copy_s, "requests": num_requests, "fates": {},
                     "lora_rank": lora, "sent_bytes": sent, "sent_fraction": sent / nbytes}
    version = 0
    for fate in [f for f in FATES if not (lora and f == "offload")]:
        pauses, catch_ups, recomputed = [], [], []
        for _ in range(repeats):
            _start_requests(engine, num_requests, prompt_len, warm_steps=3)
            version += 1
            pauses.append(sync_once(engine, fate, weights, version))
            seconds, tokens = _catch_up(engine)
            catch_ups.append(seconds)
            recomputed.append(tokens)
            engine.abort([r.request_id for r in engine.scheduler.unfinished()])
            engine.step()
        pause = statistics.median(pauses)
        results["fates"][fate] = {
            "pause_s": pause,
            "pause_over_memcpy": pause / copy_s,
            "resume_catch_up_s": statistics.median(catch_ups),
            "recomputed_tokens": int(statistics.median(recomputed)),
        }
    return results


def format_table(results: dict) -> str:
    lines = [
        f"weights: {results['weight_bytes'] / 2**20:.1f} MiB, memcpy {results['memcpy_s'] * 1e3:.2f} ms, "
        f"{results['requests']} requests in flight; each sync sends {results['sent_bytes'] / 2**20:.2f} MiB "
        f"({results['sent_fraction']:.1%} of the model"
        + (f": a rank-{results['lora_rank']} LoRA adapter)" if results.get("lora_rank") else ")"),
        f"{'fate':<10} {'pause ms':>9} {'x memcpy':>9} {'catch-up ms':>12} {'recomputed tok':>15}",
    ]
    for fate, r in results["fates"].items():
        lines.append(
            f"{fate:<10} {r['pause_s'] * 1e3:9.2f} {r['pause_over_memcpy']:9.2f} "
            f"{r['resume_catch_up_s'] * 1e3:12.1f} {r['recomputed_tokens']:15d}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="inflight bench weight-sync", description=__doc__)
    parser.add_argument("--small", action="store_true", help="a tiny model (quick check)")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--lora", type=int, default=0, metavar="RANK",
                        help="sync a LoRA adapter of this rank instead of the whole model")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny_model(
            Path(tmp) / "m", "qwen2", seed=0, **MODEL_SHAPES["tiny" if args.small else "50m"]
        )
        results = run(str(model_dir), args.requests, args.prompt_len, args.repeats, args.lora)
    print(format_table(results))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))
    return 0
