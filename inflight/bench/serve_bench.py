"""`inflight bench serve`: what the HTTP server costs, against the in-process AsyncEngine, in one run.

Workload: N requests with seeded random prompt token ids, greedy, EOS ignored, a fixed number of
output tokens, sent by C concurrent closed-loop users. Two paths are measured on each side:
- `stream`: token-by-token. In process: `AsyncEngine.generate_stream`; through the server:
  `/v1/completions` with `stream=true` (SSE, the OpenAI path), read with httpx. Gives time to first
  token and inter-token latency (p50/p99; a chunk of k tokens counts as k gaps of 1/k of its wait).
- `generate`: whole requests. In process: `AsyncEngine.generate`; through the server: RemoteClient
  on `/inflight/v1/generate` (the trainer's path). Gives requests/s and request latency.
The server runs as `python -m inflight.server` in a subprocess with the same torch thread count as the
in-process engine (the client load generator runs in this process). Both sides must produce the same
tokens (greedy; the share of identical outputs is reported: batching can flip near-ties). Overhead =
in-process requests/s / server requests/s, and server latency / in-process latency; 1.0 means free.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from inflight.bench.common import MODEL_SHAPES


@dataclass
class Trace:
    """One request: when it was sent, when its tokens arrived (time, count), and the tokens."""

    start: float
    arrivals: list[tuple[float, int]] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)

    @property
    def end(self) -> float:
        return self.arrivals[-1][0] if self.arrivals else self.start


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]



async def timed_whole(generate, prompt: list[int], params) -> Trace:
    """One non-streaming request through `generate` (engine or client), timed as a Trace."""
    trace = Trace(time.perf_counter())
    out = await generate(prompt, params)
    trace.arrivals.append((time.perf_counter(), len(out.output_token_ids)))
    trace.tokens = list(out.output_token_ids)
    return trace

def summarize(traces: list[Trace], wall_s: float) -> dict[str, float]:
    """requests/s, output tokens/s, latency percentiles (milliseconds)."""
    ttft = [(t.arrivals[0][0] - t.start) * 1e3 for t in traces if t.arrivals]
    itl: list[float] = []
    for t in traces:
        for (t0, _), (t1, k) in zip(t.arrivals, t.arrivals[1:], strict=False):
            itl.extend([(t1 - t0) * 1e3 / k] * k)
    latency = [(t.end - t.start) * 1e3 for t in traces]
    tokens = sum(len(t.tokens) for t in traces)
    return {
        "requests_per_s": len(traces) / wall_s,
        "output_tokens_per_s": tokens / wall_s,
        "wall_s": wall_s,
        "ttft_ms_p50": _pct(ttft, 50),
        "ttft_ms_p99": _pct(ttft, 99),
        "itl_ms_p50": _pct(itl, 50),
        "itl_ms_p99": _pct(itl, 99),
        "latency_ms_p50": _pct(latency, 50),
        "latency_ms_p99": _pct(latency, 99),
    }


async def _closed_loop(prompts: list[list[int]], concurrency: int, one) -> tuple[list[Trace], float]:
    sem = asyncio.Semaphore(concurrency)

    async def run(prompt: list[int]) -> Trace:
        async with sem:
            return await one(prompt)

    start = time.perf_counter()
    traces = await asyncio.gather(*(run(p) for p in prompts))
    return list(traces), time.perf_counter() - start


# ---- in process ---------------------------------------------------------------------------------
async def _inprocess(
    model_dir: str, engine_kwargs: dict, prompts, params, concurrency: int, warmup: list[list[int]]
) -> dict[str, tuple[list[Trace], float]]:
    from inflight.engine import AsyncEngine, EngineConfig

    engine = AsyncEngine.from_config(EngineConfig(model=model_dir, **engine_kwargs))

    async def stream(prompt: list[int]) -> Trace:
        trace = Trace(time.perf_counter())
        async for snap in engine.generate_stream(prompt, params):
            new = snap.output_token_ids[len(trace.tokens) :]
            if new:
                trace.arrivals.append((time.perf_counter(), len(new)))
                trace.tokens.extend(new)
        return trace

    async def whole(prompt: list[int]) -> Trace:
        return await timed_whole(engine.generate, prompt, params)

    try:
        await asyncio.gather(*(whole(p) for p in warmup))
        return {
            "stream": await _closed_loop(prompts, concurrency, stream),
            "generate": await _closed_loop(prompts, concurrency, whole),
        }
    finally:
        await engine.close()


# ---- through the server -------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model_dir: str, engine_args: list[str], threads: int, timeout_s: float = 180.0):
    """`python -m inflight.server` on a free 127.0.0.1 port; returns (process, url) once healthy."""
    import httpx

    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [
        sys.executable,
        "-m",
        "inflight.server",
        "--model",
        model_dir,
        "--port",
        str(port),
        "--served-model-name",
        "bench",
        "--threads",
        str(threads),
        "--log-level",
        "warning",
        *engine_args,
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {proc.stderr.read().decode()[-2000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=1.0).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.1)
    proc.kill()
    raise TimeoutError(f"server did not become healthy within {timeout_s} s")


async def _server(
    url: str, prompts, params, concurrency: int, warmup: list[list[int]]
) -> dict[str, tuple[list[Trace], float]]:
    import httpx

    from inflight.client import RemoteClient

    limits = httpx.Limits(max_connections=concurrency + 8, max_keepalive_connections=concurrency + 8)
    async with (
        httpx.AsyncClient(base_url=url, timeout=None, limits=limits) as http,
        RemoteClient(url, max_connections=concurrency + 8) as rc,
    ):

        async def stream(prompt: list[int]) -> Trace:
            body = {
                "model": "bench",
                "prompt": prompt,
                "max_tokens": params.max_tokens,
                "temperature": 0.0,
                "ignore_eos": True,
                "stream": True,
                "return_token_ids": True,
            }
            trace = Trace(time.perf_counter())
            async with http.stream("POST", "/v1/completions", json=body) as response:
                response.raise_for_status()
                async for line in response.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    choices = json.loads(line[6:]).get("choices") or [{}]
                    ids = choices[0].get("token_ids") or []
                    if ids:
                        trace.arrivals.append((time.perf_counter(), len(ids)))
                        trace.tokens.extend(ids)
            return trace

        async def whole(prompt: list[int]) -> Trace:
            return await timed_whole(rc.generate, prompt, params)

        await asyncio.gather(*(whole(p) for p in warmup))
        return {
            "stream": await _closed_loop(prompts, concurrency, stream),
            "generate": await _closed_loop(prompts, concurrency, whole),
        }


# ---- the run ------------------------------------------------------------------------------------
def run(
    model_dir: str,
    *,
    requests: int = 64,
    concurrency: int = 16,
    prompt_len: int = 64,
    max_tokens: int = 64,
    threads: int = 1,
    seed: int = 0,
    max_num_seqs: int = 64,
    block_size: int = 16,
) -> dict[str, Any]:
    """Measure both sides on the same workload; returns the results (see the module docstring)."""
    import torch

    from inflight.bench.common import CpuMonitor
    from inflight.engine import SamplingParams
    from inflight.engine.models.loader import load_config

    torch.set_num_threads(threads)
    vocab = load_config(model_dir).vocab_size
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, vocab) for _ in range(prompt_len)] for _ in range(requests)]
    warmup = [[rng.randrange(3, vocab) for _ in range(prompt_len)] for _ in range(min(concurrency, 4))]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    engine_kwargs = dict(block_size=block_size, max_num_seqs=max_num_seqs)
    engine_args = ["--block-size", str(block_size), "--max-num-seqs", str(max_num_seqs)]
    with CpuMonitor() as monitor:
        local = asyncio.run(_inprocess(model_dir, engine_kwargs, prompts, params, concurrency, warmup))
        proc, url = start_server(model_dir, engine_args, threads)
        try:
            remote = asyncio.run(_server(url, prompts, params, concurrency, warmup))
        finally:
            proc.kill()
            proc.wait(timeout=30)
    result: dict[str, Any] = {
        "config": {
            "requests": requests,
            "concurrency": concurrency,
            "prompt_len": prompt_len,
            "max_tokens": max_tokens,
            "threads": threads,
            "max_num_seqs": max_num_seqs,
            "block_size": block_size,
            "model_dir": model_dir,
            "cpu_count": os.cpu_count(),
        },
        "paths": {},
        "contention": monitor.summary(),
    }
    for path in ("stream", "generate"):
        (lt, lw), (rt, rw) = local[path], remote[path]
        same = sum(a.tokens == b.tokens for a, b in zip(lt, rt, strict=True)) / len(lt)
        ok = all(len(t.tokens) == max_tokens for t in lt + rt)
        inproc, server = summarize(lt, lw), summarize(rt, rw)
        overhead = {"requests_per_s": inproc["requests_per_s"] / server["requests_per_s"]}
        for key in (
            "ttft_ms_p50",
            "ttft_ms_p99",
            "itl_ms_p50",
            "itl_ms_p99",
            "latency_ms_p50",
            "latency_ms_p99",
        ):
            if path == "stream" or key.startswith("latency"):
                overhead[key] = server[key] / inproc[key] if inproc[key] > 0 else float("nan")
        result["paths"][path] = {
            "inprocess": inproc,
            "server": server,
            "overhead": overhead,
            "same_tokens_fraction": same,
            "all_complete": ok,
        }
    return result


def format_table(result: dict[str, Any]) -> str:
    c = result["config"]
    lines = [
        f"inflight bench serve: {c['requests']} requests x {c['max_tokens']} tokens "
        f"(prompt {c['prompt_len']}), {c['concurrency']} concurrent, {c['threads']} torch thread(s) per side",
        f"{'path':<9}{'side':<11}{'req/s':>8}{'tok/s':>9}{'ttft p50':>10}{'ttft p99':>10}"
        f"{'itl p50':>9}{'itl p99':>9}{'lat p50':>9}{'lat p99':>9}   (ms)",
    ]
    for path, r in result["paths"].items():
        for side in ("inprocess", "server"):
            s = r[side]
            ttft = f"{s['ttft_ms_p50']:>10.1f}{s['ttft_ms_p99']:>10.1f}" if path == "stream" else f"{'':>20}"
            itl = f"{s['itl_ms_p50']:>9.2f}{s['itl_ms_p99']:>9.2f}" if path == "stream" else f"{'':>18}"
            lines.append(
                f"{path:<9}{side:<11}{s['requests_per_s']:>8.2f}{s['output_tokens_per_s']:>9.0f}{ttft}{itl}"
                f"{s['latency_ms_p50']:>9.0f}{s['latency_ms_p99']:>9.0f}"
            )
        o = r["overhead"]
        extra = "".join(f", {k} x{v:.2f}" for k, v in o.items() if k != "requests_per_s")
        lines.append(
            f"{'':<9}overhead: requests/s x{o['requests_per_s']:.2f}{extra}; "
            f"identical outputs: {r['same_tokens_fraction']:.0%}, all complete: {r['all_complete']}"
        )
    cont = result["contention"]
    lines.append(
        f"other processes used {cont['mean_other_cores']} cores on average (max {cont['max_other_cores']})"
    )
    return "\n".join(lines)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="inflight bench serve", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--model-dir", help="a local HF model dir (default: a random model built in a temp dir)"
    )
    parser.add_argument(
        "--small", action="store_true", help="a tiny model (hidden 64, 2 layers) for smoke runs"
    )
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per side")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="write the JSON results here")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model_dir
        if model_dir is None or not (Path(model_dir) / "config.json").is_file():
            from inflight.testing import make_tiny_model

            shape = MODEL_SHAPES["tiny" if args.small else "demo"]
            model_dir = str(
                make_tiny_model(model_dir or Path(tmp) / "model", "qwen2", seed=args.seed, **shape)
            )
        result = run(
            model_dir,
            requests=args.requests,
            concurrency=args.concurrency,
            prompt_len=args.prompt_len,
            max_tokens=args.max_tokens,
            threads=args.threads,
            seed=args.seed,
            max_num_seqs=args.max_num_seqs,
            block_size=args.block_size,
        )
    print(format_table(result))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    ok = all(r["all_complete"] for r in result["paths"].values())
    if not ok:
        print("error: some requests did not return all their tokens", file=sys.stderr)
    return 0 if ok else 1


__all__ = ["format_table", "main", "run", "summarize"]

if __name__ == "__main__":
    sys.exit(main())
