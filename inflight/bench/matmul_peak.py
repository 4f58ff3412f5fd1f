"""The matmul peak a benchmark's FLOP/s are read against: the best FLOP/s of a square matmul.

It imports only the standard library and torch, so vLLM's venv (which lacks `inflight`) runs it too:
`vllm_worker.py` imports it from its own directory.

The product is 2048 x 2048 where the CPU multiplies that dtype natively, and smaller where it does not
(bfloat16 without AVX-512 runs at ~1 GFLOP/s, where one 2048 product takes over a minute): a 256
product, timed first, tells how long each size would take, and the largest that fits `budget_s` is used.
"""

from __future__ import annotations

import time

import torch

SIZES = (256, 512, 1024, 2048)


def _seconds(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> float:
    start = time.perf_counter()
    torch.matmul(a, b, out=out)
    return time.perf_counter() - start


def matmul_peak_flops(dtype: torch.dtype = torch.float32, max_n: int = 2048, repeats: int = 5,
                      budget_s: float = 1.0) -> float:
    """Best FLOP/s of an n x n @ n x n matmul with torch's current thread count (2·n³ per product),
    n the largest of `SIZES` up to `max_n` whose product is expected within `budget_s`."""
    n = pick_size(dtype, max_n, budget_s)
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    out = torch.matmul(a, b)  # warm-up, and the output buffer
    best = min(_seconds(a, b, out) for _ in range(repeats))
    return 2 * n**3 / best


def pick_size(dtype: torch.dtype, max_n: int = 2048, budget_s: float = 1.0) -> int:
    """The largest of `SIZES` up to `max_n` whose product, scaled from a timed 256 one, takes at most
    `budget_s` (256 at the least)."""
    probe = SIZES[0]
    a, b = torch.randn(probe, probe).to(dtype), torch.randn(probe, probe).to(dtype)
    out = torch.matmul(a, b)
    seconds = min(_seconds(a, b, out) for _ in range(2))
    fitting = [n for n in SIZES if n <= max_n and seconds * (n / probe) ** 3 <= budget_s]
    return max(fitting, default=probe)
