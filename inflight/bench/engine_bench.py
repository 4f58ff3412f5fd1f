"""Offline throughput: the inflight engine against `transformers` generate() and vLLM, same workload.

Workload: a random Qwen2-shaped model (~50M parameters by default; `--moe`: a Qwen3-MoE of the same
trunk whose every MLP is 8 experts of 384, 2 per token), or the model in `--model-dir` (its own shape
and vocabulary, e.g. one from `inflight models get`), N requests with prompt and
output lengths drawn uniformly (seeded), random prompt token ids, greedy, EOS ignored, so every side
must produce exactly the requested output tokens. `transformers` gets its best static batching:
requests sorted by output length, left-padded batches of a few sizes (the best one is reported); with
no stop token, every row of a batch decodes the batch's longest output and is then cut to its
requested length, so the useful output tokens are the same on every side and the extra decoding is
reported as `generated_tokens`. vLLM (`--against vllm`) runs offline `LLM.generate` on token-id
prompts from its own virtual environment (`vllm_side`). Each side runs in its own process with the
same thread count; they alternate pass by pass so that all see the same background load, and a
result is refused when other processes (or the benchmark's idle sides) used more than a few percent
of the CPUs during a timed pass. Timings are medians over `--repeats` passes after a warm-up.
Achieved FLOP/s counts the useful work (2·params per prompt or output token through the trunk, of an
MoE its router and the experts each token chose, the LM head per output token, and attention) against the best
matmul peak measured in the sides' processes (before and after the passes).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from inflight.bench import vllm_side
from inflight.bench.common import (
    TCMALLOC_NAMES,
    CpuMonitor,
    Worker,
    busy_cpu_seconds,
    cpu_name,
    find_library,
    median,
    settle,
    tree_cpu_seconds,
)
from inflight.bench.engine_images import image_workload, vllm_problem
from inflight.bench.engine_report import (
    DEFAULT_MAX_OTHER_CPU,
    agreement,
    format_profile,
    format_report,
    quiet_times,
    rates,
    refusal,
)
from inflight.bench.engine_sides import build_model, call_side, close_side, open_side
from inflight.bench.engine_workload import (
    DEFAULT_HF_BATCH_SIZES,
    BenchConfig,
    ModelShape,
    Workload,
    make_workload,
)

PEERS = ("transformers", "vllm")


# ---- orchestration ------------------------------------------------------------------------------
def _record(opened: dict[str, Any]) -> dict[str, Any]:
    return {"times_s": [], "other_cores": [], "idle_sides_cores": [], **opened}


def _timed_pass(
    record: dict[str, Any], run: Callable[[], tuple[Any, ...]], idle_pids: list[int]
) -> tuple[Any, ...]:
    """Run one pass; record its time, the cores that processes outside this benchmark used
    meanwhile (all busy CPU time less this process tree's), and those the idle sides used."""
    ours = [os.getpid()]
    busy, mine, idle = busy_cpu_seconds(), tree_cpu_seconds(ours), tree_cpu_seconds(idle_pids)
    start = time.monotonic()
    seconds, *rest = run()
    wall = time.monotonic() - start
    others = busy_cpu_seconds() - busy - (tree_cpu_seconds(ours) - mine)
    record["times_s"].append(seconds)
    record["other_cores"].append(round(max(0.0, others) / wall, 3))
    record["idle_sides_cores"].append(round((tree_cpu_seconds(idle_pids) - idle) / wall, 3))
    return tuple(rest)


def side_env(allocator: str) -> dict[str, str]:
    """The environment of the engine's and transformers' worker processes for `allocator`."""
    tcmalloc = None if allocator == "system" else find_library(TCMALLOC_NAMES)
    if tcmalloc is None and allocator == "tcmalloc":
        raise SystemExit(
            "--allocator tcmalloc: libtcmalloc_minimal.so.4 not found (Debian/Ubuntu: apt-get install "
            "libtcmalloc-minimal4); --allocator system or auto runs on glibc's malloc"
        )
    if tcmalloc is None:
        return {}
    return {"LD_PRELOAD": ":".join([tcmalloc, *filter(None, [os.environ.get("LD_PRELOAD")])])}


def _measure(cfg: BenchConfig, work: Workload, model_dir: Path) -> dict[str, dict[str, Any]]:
    """Open every side, then alternate their passes, so that all see the same background load,
    round after round until each side has `repeats` quiet passes (or `max_rounds` ran).

    Transformers times every batch size until it has a quiet pass, then its fastest one
    (`best_batch_size`, by best quiet pass) until that has enough. Returns a record per side.
    """
    with ExitStack() as stack:
        sides: dict[str, dict[str, Any]] = {}
        runs: dict[str, Callable[..., tuple[Any, ...]]] = {}
        pids: dict[str, int] = {}
        workers: dict[str, Worker] = {}
        if "vllm" in cfg.against:  # first: a missing or broken vLLM fails before the long loads
            vllm_worker, sides["vllm"] = vllm_side.start_worker(cfg)
            stack.enter_context(vllm_worker)
            pids["vllm"], runs["vllm"] = vllm_worker.pid, lambda: vllm_side.run_pass(vllm_worker)
        env = side_env(cfg.allocator)
        for kind in ("engine", "transformers"):
            if kind == "engine" or kind in cfg.against:
                worker = workers[kind] = stack.enter_context(Worker(env))
                opened = {**worker.call(open_side, kind, str(model_dir), cfg, work), "env": env}
                sides[kind] = _record(opened) if kind == "engine" else opened  # transformers: per size
                pids[kind] = worker.call(os.getpid)
                runs[kind] = lambda *args, w=worker: w.call(call_side, "run", *args)
                sides[kind]["close"] = lambda w=worker: w.call(close_side)
        if "vllm" in sides:
            sides["vllm"] = _record(
                {**sides["vllm"], **vllm_side.open_model(vllm_worker, cfg, work, str(model_dir))}
            )
            sides["vllm"]["close"] = lambda: vllm_worker.request("close", dtype=cfg.dtype)
        if "transformers" in sides:
            sides["transformers"]["batch_sizes"] = {str(b): _record({}) for b in cfg.hf_batch_sizes}
        for _ in range(cfg.max_rounds or 3 * cfg.repeats):
            if not _round(cfg, sides, runs, pids):
                break
        for side in sides.values():
            closing = side.pop("close")()
            side["peak_flops"].append(closing.pop("peak_flops_after"))
            side.update(closing)
        if cfg.profile:  # after the peak RSS was read: the profiler's events take gigabytes
            sides["engine"]["profile"] = workers["engine"].call(call_side, "profile")
    return sides


def _round(
    cfg: BenchConfig,
    sides: dict[str, dict[str, Any]],
    runs: dict[str, Callable[..., tuple[Any, ...]]],
    pids: dict[str, int],
) -> bool:
    """One timed pass of each side still short of quiet passes (transformers: of the batch sizes
    `_transformers_round` picks); False when none ran."""

    def settled_others(name: str) -> list[int]:
        """The other sides' pids, once all sides are idle."""
        settle(list(pids.values()))
        return [pid for other, pid in pids.items() if other != name]

    def short(record: dict[str, Any]) -> bool:
        return len(quiet_times(record, cfg.quiet_limit)) < cfg.repeats

    ran = False
    for name in ("engine", "vllm"):
        if name in sides and short(sides[name]):
            (sides[name]["outputs"],) = _timed_pass(sides[name], runs[name], settled_others(name))
            ran = True
    if "transformers" in sides:

        def timed_hf(size: int) -> tuple[Any, ...]:
            entry = sides["transformers"]["batch_sizes"][str(size)]
            return _timed_pass(entry, lambda: runs["transformers"](size), settled_others("transformers"))

        ran = _transformers_round(cfg, sides["transformers"], timed_hf) or ran
    return ran


def _transformers_round(
    cfg: BenchConfig, hf: dict[str, Any], timed: Callable[[int], tuple[Any, ...]]
) -> bool:
    """Time each batch size without a quiet pass yet, and the best one (by its best quiet pass)
    while it is short of quiet passes; False when none ran."""
    quiet = {b: quiet_times(hf["batch_sizes"][str(b)], cfg.quiet_limit) for b in cfg.hf_batch_sizes}
    best = min((b for b in quiet if quiet[b]), key=lambda b: min(quiet[b]), default=None)
    todo = [b for b in cfg.hf_batch_sizes if not quiet[b] or (b == best and len(quiet[b]) < cfg.repeats)]
    for size in todo:
        entry = hf["batch_sizes"][str(size)]
        entry["generated_tokens"], entry["outputs"] = timed(size)
    quiet = {b: quiet_times(hf["batch_sizes"][str(b)], cfg.quiet_limit) for b in cfg.hf_batch_sizes}
    times = {b: quiet[b] or hf["batch_sizes"][str(b)]["times_s"] for b in cfg.hf_batch_sizes}
    hf["best_batch_size"] = min(cfg.hf_batch_sizes, key=lambda b: (not quiet[b], min(times[b])))
    return bool(todo)


def _side_result(
    side: dict[str, Any],
    record: dict[str, Any],
    outputs: list[list[int]],
    work: Workload,
    cfg: BenchConfig,
    peak: float,
) -> dict[str, Any]:
    """The side's rates over its quiet passes (over all of them when none was quiet)."""
    quiet = quiet_times(record, cfg.quiet_limit)
    rate = rates(
        quiet or record["times_s"], work.output_tokens, work.prompt_tokens, work.flops["total"], peak
    )
    counts = {"quiet_passes": len(quiet), "passes": len(record["times_s"])}
    return {**side, **rate, **counts, "output_tokens": sum(len(o) for o in outputs)}


def _transformers_result(
    hf: dict[str, Any], work: Workload, cfg: BenchConfig, peak: float
) -> tuple[dict[str, Any], list[list[int]]]:
    """The best batch size's rates on top of the per-size records; and that size's outputs."""
    sizes = hf["batch_sizes"]
    for entry in sizes.values():
        entry["median_s"] = median(quiet_times(entry, cfg.quiet_limit) or entry["times_s"])
        entry["output_tok_per_s"] = work.output_tokens / entry["median_s"]
    best = sizes[str(hf["best_batch_size"])]
    outputs = best["outputs"]
    for entry in sizes.values():
        del entry["outputs"]
    return {
        **_side_result(hf, best, outputs, work, cfg, peak),
        "generated_tokens": best["generated_tokens"],
    }, outputs


def _compare(
    result: dict[str, Any], peer: str, engine_outputs: list[list[int]], peer_outputs: list[list[int]]
) -> None:
    """Engine / peer throughput ratios and greedy agreement, under the keys the report reads."""
    engine, other = result["engine"], result[peer]
    median_ratio = engine["output_tok_per_s"] / other["output_tok_per_s"]
    best_ratio = engine["best_output_tok_per_s"] / other["best_output_tok_per_s"]
    if peer == "transformers":
        result.update(
            speedup=median_ratio,
            speedup_best=best_ratio,
            greedy_agreement=agreement(engine_outputs, peer_outputs),
        )
    else:
        result.update(engine_vs_vllm=median_ratio, engine_vs_vllm_best=best_ratio)
        other["greedy_agreement_with_engine"] = agreement(engine_outputs, peer_outputs)


def run_benchmark(cfg: BenchConfig) -> dict[str, Any]:
    """Run the whole comparison and return the results (JSON-serialisable)."""
    load_start = os.getloadavg()
    work = None if cfg.images else make_workload(cfg)
    with tempfile.TemporaryDirectory(prefix="inflight-bench-") as tmp:
        model_dir = Path(cfg.model_dir or Path(tmp) / "model")
        built = cfg.model_shape is None
        with CpuMonitor() as monitor:
            build_model(cfg, model_dir)  # here: it is set-up, not measured
            if cfg.images:  # the prompts' image runs depend on the model's processor
                cfg = replace(cfg, model_shape=ModelShape.from_model_dir(model_dir))
                work = image_workload(cfg, model_dir)
            sides = _measure(cfg, work, model_dir)
        model_config = json.loads((model_dir / "config.json").read_text())
        model_type, image_token = model_config.get("model_type", "?"), model_config.get("image_token_id")
    peak = max(f for side in sides.values() for f in side["peak_flops"])
    result: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "config": {**asdict(cfg), "shape": asdict(cfg.shape)},
        "model": {"path": cfg.model_dir and str(model_dir), "model_type": model_type, "built_here": built},
        "workload": {
            "requests": cfg.requests,
            "prompt_tokens": work.prompt_tokens,
            "output_tokens": work.output_tokens,
            "flops_per_run": work.flops,
            "images": len(work.images),
            "image_tokens": sum(p.count(image_token) for p in work.prompts) if work.images else 0,
        },
        "machine": {
            "cpu": cpu_name(),
            "load_average": {"start": load_start, "end": os.getloadavg()},  # 1, 5, 15 minutes
            "cpu_count": os.cpu_count(),
            "torch_threads": cfg.threads,
            "matmul_peak_flops": peak,
            "other_load": monitor.summary(),
        },
    }
    if cfg.vllm_problem:
        result["vllm_not_run"] = cfg.vllm_problem
    engine_outputs = sides["engine"].pop("outputs")
    result["engine"] = _side_result(sides["engine"], sides["engine"], engine_outputs, work, cfg, peak)
    if "transformers" in sides:
        result["transformers"], hf_outputs = _transformers_result(sides["transformers"], work, cfg, peak)
        _compare(result, "transformers", engine_outputs, hf_outputs)
    if "vllm" in sides:
        vllm_outputs = sides["vllm"].pop("outputs")
        result["vllm"] = _side_result(sides["vllm"], sides["vllm"], vllm_outputs, work, cfg, peak)
        _compare(result, "vllm", engine_outputs, vllm_outputs)
    return result


# ---- command line --------------------------------------------------------------------------------
def _against(value: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in value.split(",") if n.strip() and n.strip() != "none")
    unknown = [n for n in names if n not in PEERS]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown peer(s) {', '.join(unknown)}; choose from {', '.join(PEERS)}, none"
        )
    return names


def _key_value(value: str) -> tuple[str, str]:
    key, sep, val = value.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {value!r}")
    return key, val


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="inflight bench engine", description=__doc__.split("\n")[0])
    add = parser.add_argument
    add(
        "--small",
        action="store_true",
        help="hidden 128, 4 layers, vocab 512 (--images: tiny_vlm's own 64 x 2)",
    )
    add("--images", action="store_true",
        help="one image per prompt on a Qwen2.5-VL (random, or --model-dir's; see bench.engine_images)")
    add("--moe", action="store_true",
        help="a Qwen3-MoE of the same trunk: every MLP 8 experts, 2 per token (FLOPs: the active experts')")
    add("--requests", type=int, default=64)
    add("--min-len", type=int, default=16, help="shortest prompt and output")
    add("--max-len", type=int, default=256, help="longest prompt and output")
    add("--dtype", choices=["float32", "bfloat16"], default="float32")
    add(
        "--against",
        type=_against,
        default=("transformers",),
        help="comma list of transformers, vllm; or none",
    )
    add("--repeats", type=int, default=3, help="quiet timed runs per side (their median is reported)")
    add("--max-rounds", type=int, default=0, help="rounds of passes at most (default: 3 x --repeats)")
    add(
        "--hf-batch-sizes",
        default=",".join(map(str, DEFAULT_HF_BATCH_SIZES)),
        help="comma-separated batch sizes tried for transformers (best reported)",
    )
    add("--threads", type=int, default=2, help="threads per side (torch threads; vLLM's bound CPUs)")
    add("--seed", type=int, default=0)
    add("--max-num-seqs", type=int, default=64)
    add("--max-num-batched-tokens", type=int, default=2048)
    add(
        "--block-size",
        type=int,
        default=None,
        help="KV block size for the engine and vLLM alike (default: each one's own, 16 and 128)",
    )
    add("--model-dir", help="benchmark the model in this HF directory (its own shape and vocabulary); "
        "an empty or new one gets the random model built there instead of in a temp dir")
    add("--profile", action="store_true", help="print a torch.profiler op table")
    add("--out", help="write the JSON results here")
    add(
        "--vllm-python",
        help=f"vLLM's interpreter (default: ${vllm_side.ENV_VAR}, else {vllm_side.DEFAULT_VENV}/bin/python)",
    )
    add(
        "--allocator",
        choices=("auto", "tcmalloc", "system"),
        default="auto",
        help="malloc of the engine's and transformers' processes: tcmalloc preloaded (as on vLLM's side, "
        "whose CPU docs ask for it; auto: where found) or glibc's",
    )
    add("--vllm-kv-cache-gib", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE")
    add(
        "--vllm-env",
        type=_key_value,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra environment for vLLM's worker (repeatable; overrides the defaults)",
    )
    add("--vllm-kwargs", type=json.loads, default={}, help="extra vllm.LLM(...) arguments, a JSON object")
    add(
        "--allow-noisy",
        action="store_true",
        help="report even when a side got fewer than --repeats quiet passes",
    )
    add("--latency", action="store_true",
        help="per-step decode latency at fixed batch sizes instead of throughput (see bench.latency)")
    add("--latency-batches", default="1,8,32", help="batch sizes of --latency (comma list)")
    add("--latency-steps", type=int, default=200, help="tokens each request decodes in --latency")
    add(
        "--max-other-cpu",
        type=float,
        default=DEFAULT_MAX_OTHER_CPU,
        help="fraction of the CPUs that others may use during a quiet timed pass",
    )
    return parser


def _parse(argv: list[str]) -> tuple[BenchConfig, argparse.Namespace]:
    parser = _parser()
    args = parser.parse_args(argv)
    if not 1 <= args.min_len <= args.max_len:
        parser.error("need 1 <= --min-len <= --max-len")
    if args.requests < 1 or args.repeats < 1:
        parser.error("--requests and --repeats must be >= 1")
    if args.images and (args.moe or args.latency):
        parser.error("--images runs a dense Qwen2.5-VL's throughput: drop --moe / --latency")
    if args.model_dir and (Path(args.model_dir) / "config.json").is_file() and (args.small or args.moe):
        parser.error(f"--small and --moe pick the shape of a random model built here; --model-dir "
                     f"{args.model_dir} holds a model already, whose own shape is benchmarked: drop them")
    cfg = BenchConfig(
        small=args.small,
        moe=args.moe,
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
        block_size=args.block_size,
        max_rounds=args.max_rounds,
        max_other_cpu=args.max_other_cpu,
        model_dir=args.model_dir,
        images=args.images,
        profile=args.profile,
        vllm_python=args.vllm_python or vllm_side.default_python(),
        vllm_kv_cache_gib=args.vllm_kv_cache_gib,
        allocator=args.allocator,
        vllm_env=dict(args.vllm_env),
        vllm_kwargs=args.vllm_kwargs,
    )
    return cfg, args


def _write(path: str | None, result: dict[str, Any]) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(result, indent=2))


def _latency(cfg: BenchConfig, args: argparse.Namespace) -> int:
    from inflight.bench.latency import format_latency, latency_main

    if args.latency_steps < 2:
        raise SystemExit("--latency-steps must be >= 2")
    batches = tuple(int(b) for b in args.latency_batches.split(","))
    cfg = replace(cfg, against=tuple(a for a in cfg.against if a == "vllm"))  # transformers has no steps
    result = latency_main(cfg, batches, args.latency_steps)
    print(format_latency(result, result["cpu"]))
    _write(args.out, result)
    return 0


def _without_vllm(cfg: BenchConfig) -> BenchConfig:
    """`cfg` without vLLM, the reason kept for the report: vLLM does not run the image workload."""
    problem = vllm_problem(cfg.vllm_python or vllm_side.default_python())
    print(f"vLLM not run: {problem}", file=sys.stderr)
    return replace(cfg, against=tuple(a for a in cfg.against if a != "vllm"), vllm_problem=problem)


def main(argv: list[str] | None = None) -> int:
    """`inflight bench engine [flags]`: run, print the table, optionally write JSON.

    Returns 0; 2 when vLLM's venv is missing or broken; 3 when a side got fewer than `--repeats`
    quiet passes (the JSON, if asked for, is still written, with `refused` set)."""
    cfg, args = _parse(sys.argv[1:] if argv is None else argv)
    try:
        if "vllm" in cfg.against:
            vllm_side.check_python(cfg.vllm_python or vllm_side.default_python())
            if cfg.images:
                cfg = _without_vllm(cfg)
        if args.latency:
            return _latency(cfg, args)
        result = run_benchmark(cfg)
    except vllm_side.VllmUnavailable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    refused = None if args.allow_noisy else refusal(result)
    if refused:
        result["refused"] = refused
        _write(args.out, result)
        print(refused, file=sys.stderr)
        return 3
    print(format_report(result))
    if "profile" in result["engine"]:
        print(format_profile(result["engine"]["profile"]))
    _write(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
