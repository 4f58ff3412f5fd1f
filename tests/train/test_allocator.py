"""`map_large_blocks`: after it, glibc serves a 2 MiB block with its own mapping even once a freed
larger mapping would have raised its threshold (glibc's own accounting, `mallinfo2`)."""

from __future__ import annotations

import ctypes
import ctypes.util
import platform

import pytest

from inflight.train.allocator import map_large_blocks

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc")


class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def _mapped_while_held(size: int) -> int:
    """How many more mapped blocks glibc holds while a block of `size` bytes is allocated."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.mallinfo2.restype = MallInfo2
    libc.malloc.restype = ctypes.c_void_p
    before = libc.mallinfo2().hblks
    block = libc.malloc(size)
    during = libc.mallinfo2().hblks
    libc.free(ctypes.c_void_p(block))
    return during - before


def _fresh_process_counts() -> None:
    """Run in a fresh interpreter: glibc serves a request from free heap memory before it maps
    anything, so the check needs a heap that earlier tests have not grown."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.malloc.restype = ctypes.c_void_p
    assert map_large_blocks()
    libc.free(ctypes.c_void_p(libc.malloc(24 << 20)))  # would raise glibc's dynamic threshold to 24 MiB
    print(_mapped_while_held(2 << 20), _mapped_while_held(64 << 10))


def test_a_block_of_a_mebibyte_or_more_is_mapped_after_a_larger_one_was_freed():
    import subprocess
    import sys
    from pathlib import Path

    here = Path(__file__).resolve().parent
    code = (f"import sys; sys.path.insert(0, {str(here)!r}); import test_allocator as t; t._fresh_process_counts()")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    big, small = map(int, out.stdout.split())
    assert big == 1  # its own mapping, returned to the system when freed
    assert small == 0  # small blocks stay on the heap
