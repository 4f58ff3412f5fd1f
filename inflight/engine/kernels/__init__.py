"""Native CPU kernels, compiled on first use with the system C compiler and loaded with ctypes.

PyTorch has no attention over a paged KV cache on CPU (`paged_attention.c` fills that gap), and its
eager elementwise ops cost one pass and one temporary each (`elementwise.c` fuses a decoder
layer's RMSNorm, residual add, rotary and silu*mul; `weight_copy.c` copies a received weight and
counts its non-finite values in the same pass).

The C sources carry one code path per ISA level (`inflight.engine.cpu.ISA_LEVELS`): AVX-512,
AVX2 + FMA, and portable C that any C11 compiler builds for any CPU (aarch64 included). One shared
library per level is built from them with that level's flags (not `-march=native`: a library is
exactly the code its level's tests ran) into a per-user cache keyed by the sources, the flags and
the compiler, so each machine compiles a level once (about two seconds).

`INFLIGHT_KERNEL_ISA` = native (default: the best level this CPU runs) | avx512 | avx2 | portable
picks the level; a level the CPU cannot run raises `NativeKernelError` naming the missing CPU
features. Where no compiler is found, `load()` returns None and callers use their PyTorch path;
`INFLIGHT_NATIVE_KERNELS=0` forces that.
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

from inflight.engine import cpu

SOURCES = sorted(Path(__file__).parent.glob("*.c"))
HEADERS = sorted(Path(__file__).parent.glob("*.h"))
ISA_CHOICES = ("native", *cpu.ISA_LEVELS)
# -ffast-math: vectorised expf (libmvec) and reassociated sums; the kernels clamp what could overflow.
# Compile flags only: linking with -ffast-math adds crtfastmath.o, whose constructor turns on
# flush-to-zero for the thread that loads the library (torch's denormals would silently become 0).
_COMMON_FLAGS = ["-O3", "-ffast-math", "-fopenmp", "-fPIC", "-std=c11"]
_LINK_FLAGS = ["-shared", "-fopenmp"]
_X86_MARCH = {"avx512": "-march=x86-64-v4", "avx2": "-march=x86-64-v3", "portable": "-march=x86-64"}
_LOCK = threading.Lock()
_LOADED: dict[str, tuple[ctypes.CDLL | None, str | None]] = {}


class NativeKernelError(RuntimeError):
    """The native kernels were required but could not be built or loaded."""


def requested_isa() -> str:
    """The value of INFLIGHT_KERNEL_ISA (default `native`), checked against the choices."""
    value = os.environ.get("INFLIGHT_KERNEL_ISA", "native").strip().lower() or "native"
    if value not in ISA_CHOICES:
        raise NativeKernelError(f"INFLIGHT_KERNEL_ISA={value!r} must be one of {list(ISA_CHOICES)}")
    return value


def resolve_isa(requested: str | None = None) -> str:
    """The ISA level to build for `requested` (default: INFLIGHT_KERNEL_ISA); `native` is the best
    level this CPU runs. A level this CPU cannot run raises NativeKernelError saying what is missing."""
    requested = requested_isa() if requested is None else requested
    if requested == "native":
        return cpu.best_isa_level()
    if requested not in cpu.ISA_LEVELS:
        raise NativeKernelError(f"kernel ISA {requested!r} must be one of {list(ISA_CHOICES)}")
    missing = cpu.missing_flags(requested)
    if missing:
        raise NativeKernelError(
            f"INFLIGHT_KERNEL_ISA={requested} needs CPU features this CPU ({cpu.cpu_model()}) lacks: "
            f"{', '.join(missing)}; set INFLIGHT_KERNEL_ISA to one of {list(cpu.runnable_isa_levels())} "
            "or to native"
        )
    return requested


def compile_flags(isa: str, machine: str | None = None) -> list[str]:
    """The compiler flags for ISA level `isa` on CPU architecture `machine` (default: this one)."""
    machine = cpu.machine() if machine is None else machine
    if machine in ("x86_64", "amd64"):
        return [*_COMMON_FLAGS, _X86_MARCH[isa]]
    if isa != "portable":
        raise NativeKernelError(f"kernel ISA {isa!r} is x86-64 only; {machine} builds the portable level")
    return list(_COMMON_FLAGS)


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def _cache_dir() -> Path:
    root = os.environ.get("INFLIGHT_KERNEL_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "inflight", "kernels"
    )
    return Path(root)


def library_path(isa: str | None = None, compiler: str | None = None) -> Path:
    """Where the shared library for these sources, this level's flags and this compiler lives."""
    isa = resolve_isa(isa)
    key = hashlib.sha256(b"".join(src.read_bytes() for src in (*SOURCES, *HEADERS)))
    key.update(" ".join([*compile_flags(isa), *_LINK_FLAGS, str(compiler or _compiler())]).encode())
    return _cache_dir() / f"inflight_kernels-{isa}-{key.hexdigest()[:16]}.so"


def build(target: Path, compiler: str, flags: list[str]) -> None:
    """Compile the sources with `flags`, then link them into `target` without them (see
    _COMMON_FLAGS); atomically: built beside the target, then renamed over it."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as work:
        objects = [str(Path(work) / f"{src.stem}.o") for src in SOURCES]
        for src, obj in zip(SOURCES, objects, strict=True):
            _run(compiler, [*flags, "-c", str(src), "-o", obj])
        tmp = str(Path(work) / target.name)
        _run(compiler, [*_LINK_FLAGS, "-o", tmp, *objects, "-lm"])
        os.replace(tmp, target)


def _run(compiler: str, args: list[str]) -> None:
    result = subprocess.run([compiler, *args], capture_output=True, text=True, timeout=120)
    if result.returncode != 0:
        names = ", ".join(src.name for src in SOURCES)
        raise NativeKernelError(f"{compiler} failed to build {names}:\n{result.stderr.strip()}")


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    ptr, long, int_ = ctypes.c_void_p, ctypes.c_long, ctypes.c_int
    signatures = {
        "paged_attention_rows": [ptr, long, ptr, ptr, long, ptr, long] + [ptr] * 6 + [int_] * 7
        + [ctypes.c_float, int_, int_],
        "fused_rms_norm": [ptr] * 4 + [long, int_, ctypes.c_float, int_, int_],
        "fused_rotary": [ptr, long, long, int_, int_, ptr, ptr, int_, int_],
        "fused_silu_mul": [ptr, ptr, long, ptr, long, int_, int_, int_],
        "kernel_isa": [],
        "copy_count_nonfinite": [ptr, ptr, long, int_, ctypes.c_uint, int_],
    }
    returns = {"copy_count_nonfinite": long}
    for name, argtypes in signatures.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = returns.get(name, ctypes.c_int), argtypes
    return lib


def load(required: bool = False, isa: str | None = None) -> ctypes.CDLL | None:
    """The compiled kernels for ISA level `isa` (default: INFLIGHT_KERNEL_ISA), built on first use;
    None when disabled or no compiler is found (with `required`, NativeKernelError naming why).

    A level this CPU cannot run, or an unknown INFLIGHT_KERNEL_ISA, always raises: an explicit
    choice is never silently replaced."""
    if os.environ.get("INFLIGHT_NATIVE_KERNELS", "1") == "0":
        lib, error = None, "disabled by INFLIGHT_NATIVE_KERNELS=0"
    else:
        level = resolve_isa(isa)
        with _LOCK:
            if level not in _LOADED:
                _LOADED[level] = _try_load(level)
            lib, error = _LOADED[level]
    if lib is None and required:
        raise NativeKernelError(f"native kernels unavailable: {error}")
    return lib


def loaded_isa(lib: ctypes.CDLL) -> str:
    """The ISA level a loaded library's code paths were compiled for (asked of the library)."""
    return cpu.ISA_LEVELS[lib.kernel_isa()]


def _try_load(isa: str) -> tuple[ctypes.CDLL | None, str | None]:
    compiler = _compiler()
    target = library_path(isa, compiler)
    try:
        if not target.exists():
            if compiler is None:
                return None, "no C compiler found (install gcc or set CC)"
            build(target, compiler, compile_flags(isa))
        lib = _bind(ctypes.CDLL(str(target)))
    except (OSError, subprocess.SubprocessError, NativeKernelError) as exc:
        return None, str(exc)
    if loaded_isa(lib) != isa:
        return None, f"the {isa} build compiled the {loaded_isa(lib)} code paths (check CC and its flags)"
    return lib, None
