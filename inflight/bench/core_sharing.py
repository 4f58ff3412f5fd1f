"""Whether two cores compute independently: a matmul's rate on one while the other runs matmuls too,
as a fraction of its rate alone.

About 1 where the two are separate physical cores; about 0.5 where they are SMT siblings of one
physical core, as a VM's two vCPUs can be whatever `lscpu` says (seen here: an Intel Xeon VM whose
"1 thread per core" vCPUs ran a 256 fp32 matmul at 111 GFLOP/s alone and 56 beside the other).
`inflight bench rl` measures it on the trainer's and the engine's cores, because its overlap bound
assumes what runs on one core does not slow the other.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import torch

_BUSY_LOOP = """
import os, torch
os.sched_setaffinity(0, {{{core}}})
torch.set_num_threads(1)
a = torch.randn({n}, {n})
out = a @ a
print("ready", flush=True)
while True:
    torch.matmul(a, a, out=out)
"""


def _rate(n: int, seconds: float) -> float:
    """FLOP/s of back-to-back n x n fp32 products on the calling thread for `seconds`."""
    a = torch.randn(n, n)
    out = a @ a
    for _ in range(3):
        torch.matmul(a, a, out=out)
    products, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds:
        torch.matmul(a, a, out=out)
        products += 1
    return 2 * n**3 * products / elapsed


def core_independence(core: int, other: int, seconds: float = 1.0, n: int = 256) -> float:
    """The matmul rate of `core` while a child process runs matmuls on `other`, over its rate with
    `other` idle (one thread each; this thread is pinned to `core` meanwhile, then restored)."""
    if core == other:
        raise ValueError(f"core_independence needs two different cores, got {core} twice")
    saved_affinity, saved_threads = os.sched_getaffinity(0), torch.get_num_threads()
    os.sched_setaffinity(0, {core})
    torch.set_num_threads(1)
    try:
        alone = _rate(n, seconds)
        child = subprocess.Popen([sys.executable, "-c", _BUSY_LOOP.format(core=other, n=n)],
                                 stdout=subprocess.PIPE, text=True)
        try:
            if child.stdout is None or child.stdout.readline().strip() != "ready":
                raise RuntimeError(f"the busy loop on core {other} did not start (exit code {child.poll()})")
            beside = _rate(n, seconds)
        finally:
            child.kill()
            child.wait()
        return beside / alone
    finally:
        torch.set_num_threads(saved_threads)
        os.sched_setaffinity(0, saved_affinity)
