"""`inflight bench engine --latency`: per-step decode latency of the engine (and vLLM) at fixed batches.

For each batch size B (default 1, 8, 32), B requests with equal-length random prompts decode
`--latency-steps` tokens each (greedy, EOS ignored), all in one batch; the per-step latency is
(time to decode `steps` tokens - time to decode 1) / (steps - 1), so the prefill and the first
token drop out and what remains is the cost of one decode step of B sequences: the model plus the
host work around it (scheduling, metadata, sampling, Python per layer), which is what separates two
engines at small batches. The prefix cache is emptied before each timing. Each side runs in its own
process with the same threads; sides and batch sizes alternate, round after round, and the median
over `--repeats` rounds is reported, with the cores other processes used during the run.
"""

from __future__ import annotations

import os
import random
import statistics
import tempfile
import time
from contextlib import ExitStack
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from inflight.bench import vllm_side
from inflight.bench.common import CpuMonitor, Worker, settle
from inflight.bench.engine_sides import build_model, call_side, close_side, open_side
from inflight.bench.engine_workload import BenchConfig, Workload

DEFAULT_BATCHES = (1, 8, 32)
DEFAULT_STEPS = 200
PROMPT_LEN = 32


def latency_workload(cfg: BenchConfig, batch: int, steps: int) -> Workload:
    """`batch` seeded random prompts of PROMPT_LEN tokens, each to decode `steps` tokens."""
    rng = random.Random(cfg.seed)
    prompts = [[rng.randrange(cfg.shape.vocab_size) for _ in range(PROMPT_LEN)] for _ in range(batch)]
    return Workload(prompts, [steps] * batch)


def run_latency(cfg: BenchConfig, model_dir: Path, batches: tuple[int, ...], steps: int) -> dict[str, Any]:
    """Per-step decode latency per batch size and side (median over cfg.repeats rounds)."""
    work = latency_workload(cfg, max(batches), steps)
    # the sides' own scheduling must never split a batch: room for every sequence at once
    cfg = replace(cfg, max_num_seqs=max(cfg.max_num_seqs, max(batches)),
                  max_num_batched_tokens=max(cfg.max_num_batched_tokens, max(batches) * PROMPT_LEN))
    samples: dict[str, dict[int, list[float]]] = {}
    with ExitStack() as stack, CpuMonitor() as monitor:
        measure: dict[str, Any] = {}
        if "vllm" in cfg.against:
            worker, info = vllm_side.start_worker(cfg)
            stack.enter_context(worker)
            vllm_side.open_model(worker, cfg, work, str(model_dir))
            measure["vllm"] = lambda b, w=worker: w.request("latency", batch=b, steps=steps)["per_step_s"]
        engine = stack.enter_context(Worker())
        engine.call(open_side, "engine", str(model_dir), cfg, work)
        measure["engine"] = lambda b: engine.call(call_side, "latency", b, steps)
        pids = [engine.call(os.getpid)] + ([worker.pid] if "vllm" in measure else [])
        for name, fn in measure.items():  # untimed: each batch size's first decode builds its kernels
            for b in batches:
                fn(b)
            samples[name] = {b: [] for b in batches}
        for _ in range(cfg.repeats):
            for b in batches:
                for name, fn in measure.items():
                    settle(pids)  # vLLM's threads stay busy a while after a call: not in the next one
                    samples[name][b].append(fn(b))
        engine.call(close_side)
    rows = {b: {name: statistics.median(samples[name][b]) for name in samples} for b in batches}
    return {"steps": steps, "prompt_len": PROMPT_LEN, "repeats": cfg.repeats, "per_step_s": rows,
            "samples_s": samples, "other_load": monitor.summary()}


def format_latency(result: dict[str, Any], cpu: str) -> str:
    """The table: ms per decode step by batch size and side, and engine / vLLM."""
    rows = result["per_step_s"]
    sides = list(next(iter(rows.values())))
    head = f"{'batch':>5} " + " ".join(f"{s + ' ms/step':>16}" for s in sides)
    lines = [f"decode latency per step ({result['steps']}-token decodes of {result['prompt_len']}-token "
             f"prompts, median of {result['repeats']}; {cpu}; other processes used "
             f"{result['other_load']['mean_other_cores']:.2f} cores on average)",
             head + (f" {'engine / vLLM':>14}" if "vllm" in sides else "")]
    for batch, row in rows.items():
        line = f"{batch:>5} " + " ".join(f"{row[s] * 1e3:16.2f}" for s in sides)
        if "vllm" in row:
            line += f" {row['engine'] / row['vllm']:14.2f}"
        lines.append(line)
    return "\n".join(lines)


def latency_main(cfg: BenchConfig, batches: tuple[int, ...], steps: int) -> dict[str, Any]:
    """Build the model (or reuse --model-dir), measure, and return the JSON result."""
    from inflight.engine.cpu import cpu_family_model, cpu_model

    with tempfile.TemporaryDirectory(prefix="inflight-latency-") as tmp:
        model_dir = Path(cfg.model_dir or Path(tmp) / "model")
        build_model(cfg, model_dir)
        result = run_latency(cfg, model_dir, batches, steps)
    result["cpu"] = f"{cpu_model()} ({cpu_family_model()})"
    result["config"] = {**asdict(cfg), "shape": asdict(cfg.shape)}
    result["date"] = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    return result
