"""`inflight bench weight-sync`: how long generation is paused for an in-process weight update.

For a ~50M-parameter Qwen2-shaped model with N requests in flight (mid-decode), each KV fate is
timed from pause() to resume() returning, beside a memcpy of the same bytes measured in the same
run; then the cost of getting back to decoding after the resume (the re-prefill of `recompute`
versus the restore of `offload`) in seconds and recomputed tokens.
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


def run(model_dir: str, num_requests: int, prompt_len: int, repeats: int) -> dict:
    engine = LLMEngine(EngineConfig(model=model_dir, max_num_batched_tokens=4096))
    weights = [(name, tensor.clone()) for name, tensor in iter_safetensors(model_dir)]  # off the mmap
    nbytes = sum(t.nbytes for _, t in weights)
    copy_s = memcpy_seconds([t for _, t in weights])
    results: dict = {"weight_bytes": nbytes, "memcpy_s": copy_s, "requests": num_requests, "fates": {}}
    version = 0
    for fate in FATES:
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
        f"{results['requests']} requests in flight",
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
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny_model(
            Path(tmp) / "m", "qwen2", seed=0, **MODEL_SHAPES["tiny" if args.small else "50m"]
        )
        results = run(str(model_dir), args.requests, args.prompt_len, args.repeats)
    print(format_table(results))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))
    return 0
