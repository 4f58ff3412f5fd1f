"""Offline throughput: the inflight engine against `transformers` generate() on the same workload.

Workload: a random Qwen2-shaped model (~50M parameters by default), N requests with prompt and
output lengths drawn uniformly (seeded), random prompt token ids, greedy, EOS ignored, so both sides
must produce exactly the requested output tokens. The baseline gets its best static batching:
requests sorted by output length, left-padded batches of a few sizes (the best one is reported); with
no stop token, every row of a batch decodes the batch's longest output and is then cut to its
requested length, so the useful output tokens are the same on both sides and the extra decoding is
reported as `generated_tokens`. Each side runs in its own spawned process with the same torch thread
count; the two alternate pass by pass so that both see the same background load. Timings are medians
over `--repeats` passes after a warm-up. Achieved FLOP/s counts the useful work (2·params per prompt
or output token through the trunk, the LM head per output token, and attention) against the best
matmul peak measured in the two processes (before and after the passes).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from inflight.bench.common import MODEL_SHAPES, CpuMonitor, Worker, median

DEFAULT_HF_BATCH_SIZES = (32, 64)


@dataclass(frozen=True)
class ModelShape:
    """The benchmark model's transformers config overrides (a Qwen2 shape)."""

    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    max_position_embeddings: int = 1024

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def trunk_matmul_params(self) -> int:
        """Weights of the per-layer matmuls (q, k, v, o, gate, up, down) over all layers."""
        h, kv = self.hidden_size, self.num_key_value_heads * self.head_dim
        return self.num_hidden_layers * (2 * h * h + 2 * h * kv + 3 * h * self.intermediate_size)


FULL_MODEL = ModelShape(**MODEL_SHAPES["50m"])  # hidden 512, 13 layers, MLP 1536, 8/4 heads, vocab 8192
SMALL_MODEL = ModelShape(128, 4, 512, 4, 2, 512)


@dataclass
class BenchConfig:
    """Everything `run_benchmark` needs; the CLI flags map onto these fields."""

    small: bool = False
    requests: int = 64
    min_len: int = 16
    max_len: int = 256
    dtype: str = "float32"
    against: str = "transformers"  # or "none"
    repeats: int = 3
    hf_batch_sizes: tuple[int, ...] = DEFAULT_HF_BATCH_SIZES
    threads: int = 2
    seed: int = 0
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    model_dir: str | None = None
    profile: bool = False  # one extra engine run under torch.profiler; the op table goes in the result

    @property
    def shape(self) -> ModelShape:
        return SMALL_MODEL if self.small else FULL_MODEL


@dataclass
class Workload:
    """The requests (prompt token ids, output lengths) and the useful FLOPs of serving them once."""

    prompts: list[list[int]]
    output_lens: list[int]
    flops: dict[str, float] = field(default_factory=dict)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)


def make_workload(cfg: BenchConfig) -> Workload:
    """Seeded random prompts and output lengths, plus the useful FLOPs of serving them once."""
    rng = random.Random(cfg.seed)
    shape = cfg.shape
    prompts, output_lens = [], []
    for _ in range(cfg.requests):
        prompts.append(
            [rng.randrange(shape.vocab_size) for _ in range(rng.randint(cfg.min_len, cfg.max_len))]
        )
        output_lens.append(rng.randint(cfg.min_len, cfg.max_len))
    work = Workload(prompts, output_lens)
    head = shape.hidden_size * shape.vocab_size
    # QK^T and AV: 2 matmuls × 2 FLOPs × heads × head_dim per attended position, per layer
    per_ctx = 4 * shape.num_hidden_layers * shape.num_attention_heads * shape.head_dim
    tokens = [len(p) + o for p, o in zip(prompts, output_lens, strict=True)]
    work.flops = {
        "matmul": 2.0 * shape.trunk_matmul_params() * sum(tokens) + 2.0 * head * work.output_tokens,
        "attention": float(per_ctx * sum(n * (n + 1) // 2 for n in tokens)),
    }
    work.flops["total"] = work.flops["matmul"] + work.flops["attention"]
    return work


# ---- the two sides, each in its own worker process -----------------------------------------------
_SIDE: dict[str, Any] = {}  # in a worker process: the loaded side


def _setup_process(threads: int) -> None:
    import torch
    from transformers.utils import logging

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    logging.disable_progress_bar()


def _measure_peak(dtype: str) -> float:
    import torch

    from inflight.bench.common import matmul_peak_flops

    return matmul_peak_flops(getattr(torch, dtype))


class EngineSide:
    """The inflight engine, loaded (timed: load + first step) and warmed up."""

    def __init__(self, model_dir: str, cfg: BenchConfig, work: Workload) -> None:
        from inflight.engine import EngineConfig, LLMEngine

        self.work = work
        engine_cfg = EngineConfig(
            model=model_dir,
            dtype=cfg.dtype,
            max_num_seqs=cfg.max_num_seqs,
            max_num_batched_tokens=cfg.max_num_batched_tokens,
            seed=cfg.seed,
        )
        start = time.perf_counter()
        self.engine = LLMEngine(engine_cfg)
        self.engine.generate([work.prompts[0]], self._params(1))
        self.startup_s = time.perf_counter() - start
        self.engine.generate(work.prompts, self._params(2))  # warm-up: every prefill, one decode step
        self.all_params = [self._params(n) for n in work.output_lens]
        self.hits_before = self.engine.stats.prefix_cache_hit_tokens

    @staticmethod
    def _params(max_tokens: int) -> Any:
        from inflight.engine import SamplingParams

        return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=True)

    def info(self) -> dict[str, Any]:
        return {"startup_s": self.startup_s, "params": sum(p.numel() for p in self.engine.model.parameters())}

    def run(self) -> tuple[float, list[list[int]]]:
        """One timed pass over the workload: (seconds, output token ids per request)."""
        self.engine.reset_prefix_cache()  # the same prompts again must not hit the cache
        start = time.perf_counter()
        outputs = self.engine.generate(self.work.prompts, self.all_params)
        return time.perf_counter() - start, [o.output_token_ids for o in outputs]

    def profile(self) -> str:
        """One pass under torch.profiler: the op table by self CPU time."""
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            self.run()
        return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)

    def finish(self) -> dict[str, Any]:
        stats = self.engine.stats
        return {
            "prefix_cache_hit_tokens": stats.prefix_cache_hit_tokens - self.hits_before,
            "preemptions": stats.preemptions,
        }


class TransformersSide:
    """`transformers` generate() with static, length-sorted, left-padded batches."""

    def __init__(self, model_dir: str, cfg: BenchConfig, work: Workload) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self.work = work
        start = time.perf_counter()
        self.model = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=getattr(torch, cfg.dtype), attn_implementation="sdpa"
        ).eval()
        self.load_s = time.perf_counter() - start
        self.pad = self.model.generation_config.pad_token_id or 0
        # like the engine's ignore_eos: no stop token (min_new_tokens would instead forbid EOS,
        # changing greedy picks whenever EOS is the top token)
        self.model.generation_config.eos_token_id = None
        self.warm: set[int] = set()

    def info(self) -> dict[str, Any]:
        return {"load_s": self.load_s}

    def batches(self, batch_size: int) -> list[list[int]]:
        work = self.work
        order = sorted(range(len(work.prompts)), key=lambda i: (work.output_lens[i], len(work.prompts[i])))
        return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]

    def run(self, batch_size: int) -> tuple[float, int, list[list[int]]]:
        """One timed pass: (seconds, tokens decoded including the cut-off ones, outputs per request)."""
        batches = self.batches(batch_size)
        if batch_size not in self.warm:
            self._generate(batches[-1:], cap=2)  # warm-up on the widest batch
            self.warm.add(batch_size)
        start = time.perf_counter()
        outputs, generated = self._generate(batches)
        return time.perf_counter() - start, generated, [outputs[i] for i in range(len(self.work.prompts))]

    def _generate(self, batches: list[list[int]], cap: int | None = None) -> tuple[dict[int, list[int]], int]:
        import torch

        work, outputs, generated = self.work, {}, 0
        for batch in batches:
            width = max(len(work.prompts[i]) for i in batch)
            ids = torch.full((len(batch), width), self.pad, dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for row, i in enumerate(batch):
                prompt = work.prompts[i]
                ids[row, width - len(prompt) :] = torch.tensor(prompt)
                mask[row, width - len(prompt) :] = 1
            steps = min(cap or 1 << 30, max(work.output_lens[i] for i in batch))
            with torch.inference_mode():
                out = self.model.generate(
                    input_ids=ids,
                    attention_mask=mask,
                    max_new_tokens=steps,
                    do_sample=False,
                    pad_token_id=self.pad,
                )
            new = out[:, width:]
            assert new.shape[1] == steps, f"transformers stopped after {new.shape[1]} of {steps} tokens"
            generated += new.numel()
            for row, i in enumerate(batch):
                outputs[i] = new[row, : work.output_lens[i]].tolist()
        return outputs, generated

    def finish(self) -> dict[str, Any]:
        return {}


_SIDES = {"engine": EngineSide, "transformers": TransformersSide}


def _open(kind: str, model_dir: str, cfg: BenchConfig, work: Workload) -> dict[str, Any]:
    """In a worker: load the side, then measure the matmul peak there."""
    _setup_process(cfg.threads)
    _SIDE["side"] = _SIDES[kind](model_dir, cfg, work)
    _SIDE["dtype"] = cfg.dtype
    return {**_SIDE["side"].info(), "peak_flops": [_measure_peak(cfg.dtype)]}


def _call(method: str, *args: Any) -> Any:
    return getattr(_SIDE["side"], method)(*args)


def _close() -> dict[str, Any]:
    """In a worker: the side's counters, a second peak measurement, the process's peak RSS."""
    from inflight.bench.common import peak_rss_mib

    return {
        **_SIDE["side"].finish(),
        "peak_flops_after": _measure_peak(_SIDE["dtype"]),
        "peak_rss_mib": peak_rss_mib(),
    }


# ---- orchestration and report ------------------------------------------------------------------
def _build_model(cfg: BenchConfig, model_dir: Path) -> None:
    from inflight.testing import make_tiny_model

    _setup_process(cfg.threads)
    if not (model_dir / "config.json").is_file():
        make_tiny_model(model_dir, "qwen2", seed=cfg.seed, **asdict(cfg.shape))


def _rates(times: list[float], work: Workload, peak: float) -> dict[str, float]:
    seconds = median(times)
    return {
        "median_s": seconds,
        "best_s": min(times),
        "best_output_tok_per_s": work.output_tokens / min(times),
        "output_tok_per_s": work.output_tokens / seconds,
        "total_tok_per_s": (work.output_tokens + work.prompt_tokens) / seconds,
        "flops_per_s": work.flops["total"] / seconds,
        "fraction_of_peak": work.flops["total"] / seconds / peak,
    }


def _agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Fraction of output tokens on the common greedy prefix of the two sides' outputs."""
    same = 0
    for x, y in zip(a, b, strict=True):
        for s, t in zip(x, y, strict=False):
            if s != t:
                break
            same += 1
    return same / max(1, sum(len(x) for x in a))


def _measure(
    cfg: BenchConfig, work: Workload, model_dir: Path
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """Alternate engine and transformers passes, so both see the same background load.

    Round one times every transformers batch size once; the fastest there (`best_batch_size`) is
    the one timed in the later rounds and reported. Each pass records its interval, so that the
    cores other processes used meanwhile can be reported (`other_cores`).
    """

    def timed_pass(worker: Worker, side: dict[str, Any], *args: Any) -> tuple[Any, ...]:
        start = time.monotonic()
        seconds, *rest = worker.call(_call, "run", *args)
        side["times_s"].append(seconds)
        side["intervals"].append((start, time.monotonic()))
        return tuple(rest)

    engine: dict[str, Any] = {"times_s": [], "intervals": []}
    hf: dict[str, Any] | None = None
    with Worker() as engine_worker, Worker() as hf_worker:
        engine.update(engine_worker.call(_open, "engine", str(model_dir), cfg, work))
        if cfg.against == "transformers":
            hf = {"batch_sizes": {str(b): {"times_s": [], "intervals": []} for b in cfg.hf_batch_sizes}}
            hf.update(hf_worker.call(_open, "transformers", str(model_dir), cfg, work))
        best: int | None = None
        for _ in range(cfg.repeats):
            (engine["outputs"],) = timed_pass(engine_worker, engine)
            if hf is None:
                continue
            for size in cfg.hf_batch_sizes if best is None else (best,):
                entry = hf["batch_sizes"][str(size)]
                entry["generated_tokens"], entry["outputs"] = timed_pass(hf_worker, entry, size)
            best = min(cfg.hf_batch_sizes, key=lambda b: hf["batch_sizes"][str(b)]["times_s"][0])
            hf["best_batch_size"] = best
        for side, worker in ((engine, engine_worker), (hf, hf_worker)):
            if side is not None:
                closing = worker.call(_close)
                side["peak_flops"].append(closing.pop("peak_flops_after"))
                side.update(closing)
        if cfg.profile:  # after the peak RSS was read: the profiler's events take gigabytes
            engine["profile"] = engine_worker.call(_call, "profile")
    return engine, hf


def run_benchmark(cfg: BenchConfig) -> dict[str, Any]:
    """Run the whole comparison and return the results (JSON-serialisable)."""
    work = make_workload(cfg)
    with tempfile.TemporaryDirectory(prefix="inflight-bench-") as tmp:
        model_dir = Path(cfg.model_dir or Path(tmp) / "model")
        with CpuMonitor() as monitor:
            _build_model(cfg, model_dir)  # here: it is set-up, not measured
            engine, hf = _measure(cfg, work, model_dir)
    for side in [engine, *(hf["batch_sizes"].values() if hf else [])]:
        side["other_cores"] = [monitor.mean_between(*span) for span in side.pop("intervals")]
    peak = max(engine["peak_flops"] + (hf["peak_flops"] if hf else []))
    engine_outputs = engine.pop("outputs")
    result: dict[str, Any] = {
        "config": {**asdict(cfg), "shape": asdict(cfg.shape)},
        "workload": {
            "requests": cfg.requests,
            "prompt_tokens": work.prompt_tokens,
            "output_tokens": work.output_tokens,
            "flops_per_run": work.flops,
        },
        "machine": {
            "cpu_count": os.cpu_count(),
            "torch_threads": cfg.threads,
            "matmul_peak_flops": peak,
            "other_load": monitor.summary(),
        },
        "engine": {
            **engine,
            **_rates(engine["times_s"], work, peak),
            "output_tokens": sum(len(o) for o in engine_outputs),
        },
    }
    if hf is not None:
        sizes = hf["batch_sizes"]
        for entry in sizes.values():
            entry["median_s"] = median(entry["times_s"])
            entry["output_tok_per_s"] = work.output_tokens / entry["median_s"]
        best = str(hf["best_batch_size"])
        hf_outputs = sizes[best]["outputs"]
        for entry in sizes.values():
            del entry["outputs"]
        result["transformers"] = {
            **hf,
            **_rates(sizes[best]["times_s"], work, peak),
            "generated_tokens": sizes[best]["generated_tokens"],
            "output_tokens": sum(len(o) for o in hf_outputs),
        }
        result["speedup"] = result["engine"]["output_tok_per_s"] / result["transformers"]["output_tok_per_s"]
        result["speedup_best"] = (
            result["engine"]["best_output_tok_per_s"] / result["transformers"]["best_output_tok_per_s"]
        )
        result["greedy_agreement"] = _agreement(engine_outputs, hf_outputs)
    return result


def _passes(side: dict[str, Any]) -> str:
    return ", ".join(f"{t:.1f}s ({c:.1f})" for t, c in zip(side["times_s"], side["other_cores"], strict=True))


def format_report(result: dict[str, Any]) -> str:
    """A plain-text table of the headline numbers."""
    wl, machine, engine = result["workload"], result["machine"], result["engine"]
    shape = result["config"]["shape"]
    lines = [
        f"model: hidden {shape['hidden_size']}, {shape['num_hidden_layers']} layers, vocab "
        f"{shape['vocab_size']}, {engine['params'] / 1e6:.1f}M params, {result['config']['dtype']}",
        f"workload: {wl['requests']} requests, {wl['prompt_tokens']} prompt + {wl['output_tokens']} output "
        f"tokens, {wl['flops_per_run']['total'] / 1e12:.2f} TFLOP per run",
        f"matmul peak: {machine['matmul_peak_flops'] / 1e9:.1f} GFLOP/s with {machine['torch_threads']} threads; "
        f"other processes used {machine['other_load']['mean_other_cores']:.2f} cores on average "
        f"(max {machine['other_load']['max_other_cores']:.2f})",
        "",
        f"{'side':<26}{'median s':>9}{'out tok/s':>10}{'all tok/s':>10}{'GFLOP/s':>8}{'% peak':>7}"
        f"{'best s':>8}{'best out tok/s':>15}{'RSS MiB':>8}",
    ]
    sides = [("inflight engine", engine)]
    if "transformers" in result:
        hf = result["transformers"]
        sides.append((f"transformers (batch {hf['best_batch_size']})", hf))
    for name, side in sides:
        lines.append(
            f"{name:<26}{side['median_s']:>9.2f}{side['output_tok_per_s']:>10.1f}{side['total_tok_per_s']:>10.1f}"
            f"{side['flops_per_s'] / 1e9:>8.1f}{100 * side['fraction_of_peak']:>7.1f}{side['best_s']:>8.2f}"
            f"{side['best_output_tok_per_s']:>15.1f}{side['peak_rss_mib']:>8.0f}"
        )
    lines += ["", f"engine startup (load + first step): {engine['startup_s']:.2f} s"]
    lines.append(f"engine passes (other processes' cores meanwhile): {_passes(engine)}")
    if "transformers" in result:
        hf = result["transformers"]
        for size, entry in hf["batch_sizes"].items():
            lines.append(
                f"transformers batch {size}: {entry['output_tok_per_s']:.1f} out tok/s; {_passes(entry)}"
            )
        lines += [
            f"transformers load: {hf['load_s']:.2f} s; decoded {hf['generated_tokens']} tokens for "
            f"{hf['output_tokens']} useful ones; engine produced {engine['output_tokens']}",
            f"speedup (engine / transformers output tok/s): {result['speedup']:.2f}x median, "
            f"{result['speedup_best']:.2f}x best pass; greedy agreement: {100 * result['greedy_agreement']:.1f}%",
        ]
    return "\n".join(lines)


def _parse(argv: list[str]) -> tuple[BenchConfig, argparse.Namespace]:
    parser = argparse.ArgumentParser(prog="inflight bench engine", description=__doc__.split("\n")[0])
    parser.add_argument("--small", action="store_true", help="hidden 128, 4 layers, vocab 512")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--min-len", type=int, default=16, help="shortest prompt and output")
    parser.add_argument("--max-len", type=int, default=256, help="longest prompt and output")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--against", choices=["transformers", "none"], default="transformers")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per side (median reported)")
    parser.add_argument(
        "--hf-batch-sizes",
        default=",".join(map(str, DEFAULT_HF_BATCH_SIZES)),
        help="comma-separated batch sizes tried for transformers (best reported)",
    )
    parser.add_argument("--threads", type=int, default=2, help="torch threads per side")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--model-dir", help="reuse (or create) the model here instead of a temp dir")
    parser.add_argument("--profile", action="store_true", help="print a torch.profiler op table")
    parser.add_argument("--out", help="write the JSON results here")
    args = parser.parse_args(argv)
    if not 1 <= args.min_len <= args.max_len:
        parser.error("need 1 <= --min-len <= --max-len")
    if args.requests < 1 or args.repeats < 1:
        parser.error("--requests and --repeats must be >= 1")
    cfg = BenchConfig(
        small=args.small,
        requests=args.requests,
        min_len=args.min_len,
        max_len=args.max_len,
        dtype=args.dtype,
        against=args.against,
        repeats=args.repeats,
        hf_batch_sizes=tuple(int(b) for b in args.hf_batch_sizes.split(",")),
        threads=args.threads,
        seed=args.seed,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        model_dir=args.model_dir,
        profile=args.profile,
    )
    return cfg, args


def main(argv: list[str] | None = None) -> int:
    """`inflight bench engine [flags]`: run, print the table, optionally write JSON. Returns 0."""
    cfg, args = _parse(sys.argv[1:] if argv is None else argv)
    result = run_benchmark(cfg)
    print(format_report(result))
    if "profile" in result["engine"]:
        print("\nengine profile (one run, torch.profiler, by self CPU time):\n" + result["engine"]["profile"])
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
