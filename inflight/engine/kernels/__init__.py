"""Native CPU kernels, compiled on first use with the system C compiler and loaded with ctypes.

PyTorch has no attention over a paged KV cache on CPU (`paged_attention.c` fills that gap), and its
eager elementwise ops cost one pass and one temporary each (`elementwise.c` fuses a decoder
layer's RMSNorm, residual add, rotary and silu*mul). One shared library is built from the C
sources next to this file into a per-user cache directory keyed by the sources, the compiler flags
and the CPU's feature flags (the code is built for the host CPU), so each machine compiles once
(about two seconds). Where no compiler is found, `load()` returns None
and callers use their PyTorch path; `INFLIGHT_NATIVE_KERNELS=0` forces that.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

_SOURCES = sorted(Path(__file__).parent.glob("*.c"))
# -ffast-math: vectorised expf (libmvec) and reassociated sums; the kernel never sees inf or nan
_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-shared", "-fPIC", "-std=c11"]
_LOCK = threading.Lock()
_LOADED: dict[str, ctypes.CDLL | None] = {}


class NativeKernelError(RuntimeError):
    """The native kernels were required but could not be built or loaded."""


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return os.uname().machine


def _cache_dir() -> Path:
    root = os.environ.get("INFLIGHT_KERNEL_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "inflight", "kernels"
    )
    return Path(root)


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def library_path() -> Path:
    """Where the shared library for this source, these flags and this CPU lives (built or not)."""
    key = hashlib.sha256(b"".join(src.read_bytes() for src in _SOURCES))
    key.update(" ".join(_FLAGS).encode() + _cpu_flags().encode())
    return _cache_dir() / f"inflight_kernels-{key.hexdigest()[:16]}.so"


def _build(target: Path, compiler: str) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    # build beside the target and rename: concurrent processes never load a half-written file
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        result = subprocess.run([compiler, *_FLAGS, "-o", tmp, *map(str, _SOURCES), "-lm"],
                                capture_output=True, text=True, timeout=120)
        if result.returncode != 0:
            names = ", ".join(src.name for src in _SOURCES)
            raise NativeKernelError(f"{compiler} failed to build {names}:\n{result.stderr.strip()}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    ptr, long, int_ = ctypes.c_void_p, ctypes.c_long, ctypes.c_int
    signatures = {
        "paged_attention_rows": [ptr, long, ptr, ptr, long, ptr, long] + [ptr] * 6 + [int_] * 7
        + [ctypes.c_float, int_, int_],
        "fused_rms_norm": [ptr] * 4 + [long, int_, ctypes.c_float, int_, int_],
        "fused_rotary": [ptr, long, long, int_, int_, ptr, ptr, int_, int_],
        "fused_silu_mul": [ptr, ptr, long, ptr, long, int_, int_, int_],
    }
    for name, argtypes in signatures.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = ctypes.c_int, argtypes
    return lib


def load(required: bool = False) -> ctypes.CDLL | None:
    """The compiled kernels (built on first use), or None when disabled or no compiler is found.

    With `required`, failure raises NativeKernelError naming the reason instead.
    """
    with _LOCK:
        if "lib" not in _LOADED:
            _LOADED["lib"], _LOADED["error"] = _try_load()
        lib, error = _LOADED["lib"], _LOADED["error"]
    if lib is None and required:
        raise NativeKernelError(f"native attention kernel unavailable: {error}")
    return lib


def _try_load() -> tuple[ctypes.CDLL | None, str | None]:
    if os.environ.get("INFLIGHT_NATIVE_KERNELS", "1") == "0":
        return None, "disabled by INFLIGHT_NATIVE_KERNELS=0"
    compiler = _compiler()
    target = library_path()
    try:
        if not target.exists():
            if compiler is None:
                return None, "no C compiler found (install gcc or set CC)"
            _build(target, compiler)
        return _bind(ctypes.CDLL(str(target))), None
    except (OSError, subprocess.SubprocessError, NativeKernelError) as exc:
        return None, str(exc)
