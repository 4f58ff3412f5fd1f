"""`inflight bench weight-sync --server native|vllm`: how long generation pauses for a weight update
into an HTTP server, the way a run on servers syncs (`inflight.orchestration.servers`).

One server (`inflight serve`, native or `--backend vllm`) is started on a random-init model of a
named shape (default Qwen2.5-0.5B's); with `--requests` greedy requests decoding, each repeat times
pause(keep) -> the full update as safetensors chunks over HTTP (`update_all_or_nothing` with the
in-process transport, the executor's send) -> resume, and checks that the requests in flight span the versions
(a sync with none in flight fails the run: raise --max-tokens). Reported: seconds per sync (median, all),
bytes, bytes/s; the device and dtype named.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

from inflight.backends.registry import backend_entry, backend_names
from inflight.bench.train_step_bench import SHAPES
from inflight.client.remote import RemoteClient
from inflight.client.update import UpdateProgress, update_all_or_nothing
from inflight.config import load_config
from inflight.engine.config import EngineConfig
from inflight.engine.request import SamplingParams
from inflight.orchestration.server_fleet import ServerFleet
from inflight.orchestration.servers import CONTROL_TOKEN_ENV
from inflight.weight_sync.inprocess import InProcessTransport

TOKEN = "bench-server-sync"


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="inflight bench weight-sync --server", description=__doc__.split("\n\n")[0]
    )
    p.add_argument(
        "--server", choices=[n for n in backend_names() if backend_entry(n).run_starts_servers], required=True
    )
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-0.5b")
    p.add_argument("--device", default="cpu", help="the server's device (cpu, cuda)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--requests", type=int, default=8, help="greedy requests decoding during each sync")
    p.add_argument("--max-tokens", type=int, default=1000, help="tokens per request (max_model_len is 1024)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="the server's torch threads")
    p.add_argument("--vllm-python", default=None, help="vLLM's python (default: the shim's)")
    p.add_argument("--out", default=None, help="write the JSON results here")
    return p.parse_args(argv)


def _command(args: argparse.Namespace, model_dir: Path):
    """The server's command line for a port, built by its backend's entry (`Backend.server_command`)."""
    engine = EngineConfig(model=str(model_dir), device=args.device, dtype=args.dtype, max_model_len=1024)
    ie = "generator.inference_engine."
    python = [f"{ie}vllm_python={args.vllm_python}"] if args.vllm_python else []
    cfg = load_config(None, [f"{ie}backend={args.server}", f"{ie}device={args.device}", *python])
    return partial(backend_entry(args.server).server_argv, cfg, engine, threads=args.threads)


async def _measure(args: argparse.Namespace, url: str, tensors: dict[str, Any]) -> dict[str, Any]:
    client = RemoteClient(url, control_token=TOKEN)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    times, spans, progress = [], [], UpdateProgress()
    try:
        for version in range(1, args.repeats + 1):
            calls = [
                asyncio.ensure_future(client.generate([5 + i, 7, 11], params)) for i in range(args.requests)
            ]
            while (await client.status())[url]["num_running"] < args.requests:
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.2)  # a few decode steps in
            began = time.perf_counter()
            await client.pause("keep")
            progress = UpdateProgress()
            await update_all_or_nothing(client, InProcessTransport(), tensors.items(), version, progress)
            await client.resume()
            times.append(time.perf_counter() - began)
            outs = await asyncio.gather(*calls)
            spans.append(sum(set(o.token_weight_versions) == {version - 1, version} for o in outs))
    finally:
        await client.close()
    return {"sync_s": times, "median_sync_s": statistics.median(times), "bytes": progress.bytes,
            "bytes_per_s": progress.bytes / statistics.median(times), "requests_spanning_the_sync": spans}


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; prints one line and writes `--out`."""
    args = _parse(argv)
    from safetensors.torch import load_file

    from inflight.testing import make_tiny_model

    with tempfile.TemporaryDirectory(prefix="inflight-server-sync-") as tmp:
        model_dir = make_tiny_model(Path(tmp) / "model", "qwen2", 0, **SHAPES[args.shape])
        tensors = {k: v for f in sorted(model_dir.glob("*.safetensors")) for k, v in load_file(f).items()}
        fleet = ServerFleet(Path(tmp) / "logs", env={CONTROL_TOKEN_ENV: TOKEN})

        async def run() -> dict[str, Any]:
            try:
                (url,) = await fleet.start(
                    [_command(args, model_dir)], backend_entry(args.server).start_timeout_s
                )
                return await _measure(args, url, tensors)
            finally:
                await fleet.close()

        result = {"server": args.server, "shape": args.shape, "device": args.device, "dtype": args.dtype,
                  "requests": args.requests, **asyncio.run(run())}
    print(
        f"weight sync into a {args.server} server ({args.shape}, {args.dtype} on {args.device}, "
        f"{args.requests} requests decoding, spanning: {result['requests_spanning_the_sync']}): "
        f"{result['median_sync_s']:.3f} s median of {args.repeats}, {result['bytes'] / 2**20:.0f} MiB at "
        f"{result['bytes_per_s'] / 2**20:.0f} MiB/s over HTTP"
    )
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    if not all(result["requests_spanning_the_sync"]):
        print("error: a sync found no request in flight (raise --max-tokens): it timed an idle server")
        return 1
    return 0
