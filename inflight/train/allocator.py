"""glibc's malloc in a training process: every block of 1 MiB or more gets its own mapping, given
back to the system when freed.

glibc raises its mmap threshold as mapped blocks are freed (up to 32 MiB), after which a step's
activations (20 MB each at 1,024 tokens x a 4,864-wide MLP) come from the heap; the transient ones
freed between the kept ones leave holes the heap cannot give back, and the process's peak resident
memory grows by them (measured on the Qwen2.5-0.5B shape: 2 GB of a LoRA step's 7.2 GB peak, see
`inflight bench train-step`). A fixed threshold keeps large tensors mapped, so freeing one returns
its memory at once. Elsewhere than glibc (or with another allocator preloaded) this does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import platform

M_MMAP_THRESHOLD = -3
THRESHOLD = 1 << 20


def map_large_blocks(threshold: int = THRESHOLD) -> bool:
    """Set glibc's mmap threshold to `threshold` bytes (fixed: no longer raised on frees); True if set."""
    if platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    return bool(libc.mallopt(M_MMAP_THRESHOLD, threshold))
