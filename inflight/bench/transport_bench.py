"""`inflight bench weight-sync --transport ...`: bytes/s and pause time of each weight transport.

One complete weight update (begin, every chunk, finish) of a ~50M-parameter Qwen2-shaped model
(~500M with `--large`, Qwen2.5-1.5B's shape with `--xl`, in bfloat16 unless `--dtype` says
otherwise: 3 GB, where float32 weights on both sides and the rollback copy would not fit 24 GiB)
is timed per transport, beside a memcpy of the same bytes measured in the same run:

- `inprocess`: the engine lives in this process; the tensors go to `load_weights` directly.
- `shm`: the engine lives in a spawned process; the bytes go through shared memory, packed there
  before the pause (`stage`, the default; its time is reported apart: the engines still generate).
- `shm-pipelined`: the same, packed chunk by chunk during the pause (`weight_sync_staged=false`).
- `broadcast`: the engine lives in a spawned process; the bytes go through a gloo broadcast.

With a `keep` KV fate the generation pause is this update time plus pause/resume calls (well under
a millisecond in process); the engine's own copy into its parameters is included, as in a real
sync. A first, untimed update warms both sides (process start-up, first touch of the buffers).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import statistics
import tempfile
import time
from pathlib import Path

import torch

from inflight.bench.common import MODEL_SHAPES, CpuMonitor
from inflight.bench.weight_sync_bench import memcpy_seconds
from inflight.engine import EngineConfig, LLMEngine
from inflight.engine.models.loader import iter_safetensors
from inflight.testing import make_tiny_model
from inflight.weight_sync.kinds import BROADCAST, INPROCESS, SHM, SenderSite, TransportSpec

TRANSPORTS: dict[str, tuple[TransportSpec, bool]] = {
    "inprocess": (INPROCESS, True),
    "shm": (SHM, True),
    "shm-pipelined": (SHM, False),
    "broadcast": (BROADCAST, True),
}
"""{variant: (its transport kind, whether its sender packs an update before the pause)}."""


def _engine(model_dir: str, rollback: bool, dtype: str = "float32") -> LLMEngine:
    config = EngineConfig(model=model_dir, num_kv_blocks=16, max_num_seqs=4, weight_update_rollback=rollback,
                          dtype=dtype)
    return LLMEngine(config)


def _engine_process(spec: TransportSpec, port: int, model_dir: str, threads: int, rollback: bool,
                    dtype: str) -> None:
    """Spawned: an engine serving weight updates from this benchmark until it closes the transport."""
    torch.set_num_threads(threads)
    engine = _engine(model_dir, rollback, dtype)
    spec.build_receiver("127.0.0.1", port, timeout=1800).serve(engine)


async def timed_update(
    transport, client, weights: list[tuple[str, torch.Tensor]], version: int
) -> tuple[float, float, int]:
    """One complete update through `transport`, staged first as the sync executor does; returns
    (staging seconds, update seconds: the pause, chunks)."""
    start = time.perf_counter()
    update = await transport.stage(weights)
    staged = time.perf_counter()
    await transport.begin(client)
    chunks = 0
    for chunk in transport.chunks(update):
        await transport.send_chunk(client, chunk)
        chunks += 1
    await transport.finish(client, version)
    return staged - start, time.perf_counter() - staged, chunks


def bench_transport(
    kind: str, model_dir: str, weights, chunk_bytes: int, repeats: int, threads: int, rollback: bool = True,
    dtype: str = "float32",
) -> dict:
    client, child = None, None
    spec, staged = TRANSPORTS[kind]
    transport = spec.build_sender(SenderSite("127.0.0.1", 0, 1, chunk_bytes, timeout=1800, staged=staged))
    if spec.in_trainer_process:
        from inflight.client import LocalClient
        from inflight.engine import AsyncEngine

        client = LocalClient(AsyncEngine(_engine(model_dir, rollback, dtype)))
    else:
        child = mp.get_context("spawn").Process(
            target=_engine_process,
            args=(spec, transport.port, model_dir, threads, rollback, dtype),
            daemon=True,
        )
        child.start()
    try:
        timings, stagings, chunks = [], [], 0
        for version in range(1, repeats + 2):
            stage_s, seconds, chunks = asyncio.run(timed_update(transport, client, weights, version))
            if version > 1:  # the first one warms up
                timings.append(seconds)
                stagings.append(stage_s)
    finally:
        transport.close()
        if child is not None:
            child.join(60)
        del client  # the in-process engine's weights go before the next transport's engine comes
    update = statistics.median(timings)
    return {
        "update_s": update,
        "best_s": min(timings),
        "stage_s": statistics.median(stagings),
        "chunks": chunks,
    }


def run(
    model_dir: str,
    transports: list[str],
    chunk_bytes: int,
    repeats: int,
    threads: int,
    rollback: bool = True,
    dtype: str = "float32",
) -> dict:
    """Every transport in `transports` on this model, weights and engines in `dtype`; `rollback`:
    the engines keep the pre-update weights until an update completes (the default)."""
    wire = getattr(torch, dtype)
    weights = [(name, tensor.to(wire, copy=True)) for name, tensor in iter_safetensors(model_dir)]
    nbytes = sum(t.nbytes for _, t in weights)
    copy_s = memcpy_seconds([t for _, t in weights])
    results: dict = {
        "weight_bytes": nbytes,
        "params": sum(t.numel() for _, t in weights),
        "memcpy_s": copy_s,
        "memcpy_bytes_per_s": nbytes / copy_s,
        "chunk_bytes": chunk_bytes,
        "threads": threads,
        "rollback": rollback,
        "dtype": dtype,
        "transports": {},
    }
    with CpuMonitor() as monitor:
        for kind in transports:
            results["transports"][kind] = bench_transport(
                kind, model_dir, weights, chunk_bytes, repeats, threads, rollback, dtype
            )
    results["cpu_contention"] = monitor.summary()
    for r in results["transports"].values():
        r["bytes_per_s"] = nbytes / r["update_s"]
        r["pause_over_memcpy"] = r["update_s"] / copy_s
    return results


def format_table(results: dict) -> str:
    lines = [
        f"weights: {results['params'] / 1e6:.1f}M parameters, {results['weight_bytes'] / 2**20:.1f} MiB "
        f"in {results.get('dtype', 'float32')}; "
        f"memcpy {results['memcpy_s'] * 1e3:.1f} ms ({results['memcpy_bytes_per_s'] / 1e9:.2f} GB/s); "
        f"chunks of {results['chunk_bytes'] / 2**20:.0f} MiB, {results['threads']} thread(s) per process, "
        f"engine rollback {'on' if results['rollback'] else 'off'}; other processes used "
        f"{results['cpu_contention']['mean_other_cores']:.2f} cores on average",
        f"{'transport':<14} {'pause ms':>10} {'best ms':>9} {'GB/s':>7} {'x memcpy':>9} {'chunks':>7} "
        f"{'staged ms':>10}",
    ]
    for kind, r in results["transports"].items():
        lines.append(
            f"{kind:<14} {r['update_s'] * 1e3:10.1f} {r['best_s'] * 1e3:9.1f} {r['bytes_per_s'] / 1e9:7.3f} "
            f"{r['pause_over_memcpy']:9.2f} {r['chunks']:7d} {r.get('stage_s', 0.0) * 1e3:10.1f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="inflight bench weight-sync --transport", description=__doc__)
    parser.add_argument("--transport", default="all", choices=[*TRANSPORTS, "all"])
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--large", action="store_true", help="a ~500M-parameter model (2 GB in float32)")
    size.add_argument(
        "--xl", action="store_true", help="Qwen2.5-1.5B's shape (1.54B parameters; bfloat16 by default)"
    )
    size.add_argument("--small", action="store_true", help="a tiny model (quick check)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"],
                        help="weights sent and engine dtype (default float32; bfloat16 with --xl)")
    parser.add_argument("--chunk-mib", type=float, default=64.0, help="chunk size / shared buffer capacity")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--model", help="use this HF model directory instead of building one")
    parser.add_argument(
        "--no-rollback",
        action="store_true",
        help="engines without weight_update_rollback (no fresh allocation)",
    )
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    transports = list(TRANSPORTS) if args.transport == "all" else [args.transport]
    chunk_bytes = int(args.chunk_mib * 2**20)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model
        if model_dir is None:
            shape = MODEL_SHAPES[
                "tiny" if args.small else "500m" if args.large else "1.5b" if args.xl else "50m"
            ]
            model_dir = str(make_tiny_model(Path(tmp) / "m", "qwen2", seed=0, **shape))
        dtype = args.dtype or ("bfloat16" if args.xl else "float32")
        results = run(
            model_dir, transports, chunk_bytes, args.repeats, args.threads, not args.no_rollback, dtype
        )
    print(format_table(results))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))
    return 0
