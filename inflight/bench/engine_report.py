"""The numbers and text of `inflight bench engine`: rates, agreement, the contention check, the table."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from inflight.bench.common import median

# a timed pass is quiet when other processes used at most this fraction of the CPUs meanwhile
DEFAULT_MAX_OTHER_CPU = 0.05


def rates(
    times: list[float], output_tokens: int, prompt_tokens: int, flops: float, peak: float
) -> dict[str, float]:
    """Median and best throughput of a side's timed passes, and its fraction of the matmul peak."""
    seconds = median(times)
    return {
        "median_s": seconds,
        "best_s": min(times),
        "best_output_tok_per_s": output_tokens / min(times),
        "output_tok_per_s": output_tokens / seconds,
        "total_tok_per_s": (output_tokens + prompt_tokens) / seconds,
        "flops_per_s": flops / seconds,
        "fraction_of_peak": flops / seconds / peak,
    }


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Fraction of output tokens on the common greedy prefix of the two sides' outputs."""
    same = 0
    for x, y in zip(a, b, strict=True):
        for s, t in zip(x, y, strict=False):
            if s != t:
                break
            same += 1
    return same / max(1, sum(len(x) for x in a))


def quiet_times(record: dict[str, Any], limit: float) -> list[float]:
    """The times of a side's passes during which other processes, and the benchmark's idle sides,
    used at most `limit` cores (a NaN load is not quiet)."""
    loads = zip(record["times_s"], record["other_cores"], record["idle_sides_cores"], strict=True)
    return [t for t, other, idle in loads if other + idle <= limit]


def _limit(result: dict[str, Any]) -> float:
    return result["config"]["max_other_cpu"] * result["machine"]["cpu_count"]


def reported_sides(result: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(name, record) of each side's reported series of timed passes (transformers: its best size)."""
    yield "engine", result["engine"]
    if "transformers" in result:
        best = result["transformers"]["best_batch_size"]
        yield f"transformers batch {best}", result["transformers"]["batch_sizes"][str(best)]
    if "vllm" in result:
        yield "vllm", result["vllm"]


def noisy_passes(result: dict[str, Any]) -> list[str]:
    """One line per reported pass that was not quiet."""
    limit, lines = _limit(result), []
    for name, side in reported_sides(result):
        loads = zip(side["times_s"], side["other_cores"], side["idle_sides_cores"], strict=True)
        for i, (t, other, idle) in enumerate(loads):
            if not other + idle <= limit:
                lines.append(
                    f"{name} pass {i + 1} ({t:.2f} s): other processes used {other:.2f} cores, "
                    f"the benchmark's idle sides {idle:.2f} (limit {limit:.2f})"
                )
    return lines


def refusal(result: dict[str, Any]) -> str | None:
    """Why the result must not be reported (a side got fewer than `repeats` quiet passes), or None."""
    limit, wanted = _limit(result), result["config"]["repeats"]
    short = [
        f"{name}: {len(quiet_times(side, limit))} of {wanted} quiet passes in {len(side['times_s'])}"
        for name, side in reported_sides(result)
        if len(quiet_times(side, limit)) < wanted
    ]
    if not short:
        return None
    load = result["machine"]["other_load"]
    top = ", ".join(f"{p['name']} {p['core_seconds']:.1f} core-s" for p in load["top_other_processes"])
    return "\n".join(
        [
            f"refusing to report: a timed pass is quiet when other processes used at most "
            f"{100 * result['config']['max_other_cpu']:.0f}% of the {result['machine']['cpu_count']} CPUs "
            f"({limit:.2f} cores); too few were: {'; '.join(short)}",
            *(f"  {line}" for line in noisy_passes(result)),
            f"other processes over the whole run: {load['mean_other_cores']:.2f} cores on average "
            f"(max {load['max_other_cores']:.2f}); busiest: {top or 'none'}",
            "rerun on a quieter machine, raise --max-rounds, or pass --allow-noisy to report anyway",
        ]
    )


def _passes(side: dict[str, Any]) -> str:
    loads = zip(side["times_s"], side["other_cores"], side["idle_sides_cores"], strict=True)
    return ", ".join(f"{t:.2f}s ({c:.2f}/{i:.2f})" for t, c, i in loads)


def _row(name: str, side: dict[str, Any]) -> str:
    return (
        f"{name:<26}{side['median_s']:>9.2f}{side['output_tok_per_s']:>10.1f}{side['total_tok_per_s']:>10.1f}"
        f"{side['flops_per_s'] / 1e9:>8.1f}{100 * side['fraction_of_peak']:>7.1f}{side['best_s']:>8.2f}"
        f"{side['best_output_tok_per_s']:>15.1f}{side['peak_rss_mib']:>8.0f}"
    )


def _block_sizes(result: dict[str, Any]) -> str:
    chosen = result["config"].get("block_size")
    if chosen is not None:
        return f"{chosen} on every side"
    return f"engine {result['engine'].get('block_size', '?')}, vLLM its default (128 on CPU)"


def _model_name(result: dict[str, Any]) -> str:
    """Where the benchmarked model came from: its directory, or a random one of the built-in shape."""
    model = result.get("model", {})
    path = model.get("path")
    if not model.get("built_here", True):
        return f"{model['model_type']} from {path}"
    return f"random {model.get('model_type', 'qwen2')}, built {'in ' + path if path else 'here'}"


def _header(result: dict[str, Any]) -> list[str]:
    wl, machine, engine = result["workload"], result["machine"], result["engine"]
    shape = result["config"]["shape"]
    experts = ""
    if shape.get("num_experts"):
        experts = (f", MoE: {shape['num_experts']} experts of {shape['moe_intermediate_size']}, "
                   f"{shape['num_experts_per_tok']} per token (FLOPs: the active ones)")
    images = ""
    if wl.get("images"):
        images = (f" ({wl['images']} images, one per prompt, {wl['image_tokens']} image tokens; FLOPs: the "
                  "language model's, not the vision tower's)")
    cpu = ""
    if "cpu" in machine:
        load = {when: ", ".join(f"{x:.2f}" for x in avg) for when, avg in machine["load_average"].items()}
        cpu = (
            f"CPU: {machine['cpu']}; load average (1, 5, 15 min) {load['start']} at the start, "
            f"{load['end']} at the end"
        )
    return [
        f"model: {_model_name(result)}, hidden {shape['hidden_size']}, {shape['num_hidden_layers']} layers, "
        f"vocab {shape['vocab_size']}{experts}, {engine['params'] / 1e6:.1f}M params, "
        f"{result['config']['dtype']}; KV block size {_block_sizes(result)}",
        f"workload: {wl['requests']} requests, {wl['prompt_tokens']} prompt + {wl['output_tokens']} output "
        f"tokens{images}, {wl['flops_per_run']['total'] / 1e12:.2f} TFLOP per run",
        *([cpu] if cpu else []),
        f"matmul peak: {machine['matmul_peak_flops'] / 1e9:.1f} GFLOP/s with {machine['torch_threads']} "
        f"threads; other processes used {machine['other_load']['mean_other_cores']:.2f} cores on average "
        f"(max {machine['other_load']['max_other_cores']:.2f})",
        "",
        f"{'side':<26}{'median s':>9}{'out tok/s':>10}{'all tok/s':>10}{'GFLOP/s':>8}{'% peak':>7}"
        f"{'best s':>8}{'best out tok/s':>15}{'RSS MiB':>8}",
    ]


def _transformers_lines(result: dict[str, Any]) -> list[str]:
    hf, engine = result["transformers"], result["engine"]
    lines = [
        f"transformers batch {size}: {entry['output_tok_per_s']:.1f} out tok/s; {_passes(entry)}"
        for size, entry in hf["batch_sizes"].items()
    ]
    return lines + [
        f"transformers load: {hf['load_s']:.2f} s; decoded {hf['generated_tokens']} tokens for "
        f"{hf['output_tokens']} useful ones; engine produced {engine['output_tokens']}",
        f"speedup (engine / transformers output tok/s): {result['speedup']:.2f}x median, "
        f"{result['speedup_best']:.2f}x best pass; greedy agreement: {100 * result['greedy_agreement']:.1f}%",
    ]


def _vllm_lines(result: dict[str, Any]) -> list[str]:
    v = result["vllm"]
    init = "?" if v["engine_init_s"] is None else f"{v['engine_init_s']:.1f}"
    return [
        f"vLLM {v['version']} startup (LLM() + first step): {v['startup_s']:.2f} s, of which engine init "
        f"(profile, KV cache, warm-up) {init} s; model {v['compile']}; import {v['import_s']:.2f} s; "
        f"full-size warm-up pass {v['warmup_s']:.2f} s",
        f"vLLM passes ({v['quiet_passes']} quiet of {v['passes']}): {_passes(v)}; "
        f"RSS summed over its {len(v['peak_rss_mib_by_pid'])} processes",
        f"vLLM settings: {' '.join(f'{k}={val}' for k, val in v['env'].items())}",
        f"engine / vLLM output tok/s: {result['engine_vs_vllm']:.2f}x median, "
        f"{result['engine_vs_vllm_best']:.2f}x best pass; greedy agreement: "
        f"{100 * v['greedy_agreement_with_engine']:.1f}%",
    ]


def _preload(env: dict[str, str]) -> str:
    if "LD_PRELOAD" in env:
        return f"LD_PRELOAD={env['LD_PRELOAD']} (--allocator system: glibc's malloc)"
    return "glibc's malloc (tcmalloc, which vLLM's side preloads, not found or --allocator system)"


def format_report(result: dict[str, Any]) -> str:
    """A plain-text table of the headline numbers, then the details of each side."""
    engine = result["engine"]
    lines = _header(result)
    lines.append(_row("inflight engine", engine))
    if "transformers" in result:
        lines.append(
            _row(f"transformers (batch {result['transformers']['best_batch_size']})", result["transformers"])
        )
    if "vllm" in result:
        lines.append(_row("vLLM", result["vllm"]))
    lines += [
        "",
        f"engine startup (load + first step): {engine['startup_s']:.2f} s; full-size warm-up pass "
        f"{engine.get('warmup_s', float('nan')):.2f} s",
        "passes: seconds (cores used meanwhile by other processes / by this benchmark's idle sides); "
        f"medians over the quiet ones (at most {_limit(result):.2f} cores used)",
        f"engine passes ({engine['quiet_passes']} quiet of {engine['passes']}): {_passes(engine)}",
        f"engine (and transformers) process: {_preload(engine.get('env', {}))}",
    ]
    if "transformers" in result:
        lines += _transformers_lines(result)
    if "vllm" in result:
        lines += _vllm_lines(result)
    if "vllm_not_run" in result:
        lines.append(f"vLLM not run: {result['vllm_not_run']}")
    return "\n".join(lines)


def format_profile(profile: dict[str, Any]) -> str:
    """The engine's profiled pass: where its wall time went by kind, then torch.profiler's op table
    (the native kernels as `inflight::<name>`)."""
    wall = profile["wall_s"]
    split = ", ".join(f"{kind} {s:.2f} s ({s / wall:.0%})" for kind, s in profile["split_s"].items())
    return (f"\nengine profile (one pass under torch.profiler, {wall:.2f} s with its overhead): {split}\n"
            f"ops by self CPU time:\n{profile['table']}")
