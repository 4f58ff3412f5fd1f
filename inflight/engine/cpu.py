"""What the running CPU and torch build can do: the facts every CPU fast path is chosen from.

The machines the engine runs on are not all one kind (AVX-512 servers, AVX2-only laptops and cloud
VMs, aarch64), so nothing here assumes: the kernel ISA levels come from the CPU's flags, and what
oneDNN can pack is asked of oneDNN itself, once per process, with a tiny matmul.
"""

from __future__ import annotations

import functools
import os
import platform
from pathlib import Path

import torch

# Kernel ISA levels, best first, and the CPU flags (as /proc/cpuinfo spells them) each one needs.
ISA_LEVELS = ("avx512", "avx2", "portable")
ISA_FLAGS: dict[str, tuple[str, ...]] = {
    "avx512": ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd", "avx2", "fma", "f16c", "bmi2"),
    "avx2": ("avx2", "fma", "f16c", "bmi2"),
    "portable": (),
}
_X86 = ("x86_64", "amd64", "i686", "i386")


def machine() -> str:
    """The CPU architecture, lower case (`x86_64`, `aarch64`, `arm64`)."""
    return platform.machine().lower()


def is_x86() -> bool:
    return machine() in _X86


def _cpuinfo_field(name: str) -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.split(":")[0].strip() == name:
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (Linux /proc/cpuinfo; empty where it cannot be read)."""
    return frozenset(_cpuinfo_field("flags").split())


@functools.cache
def cpu_model() -> str:
    """The CPU's model name (`AMD EPYC 7B13`), or the architecture where it cannot be read."""
    return _cpuinfo_field("model name") or platform.processor() or machine()


def cpu_family_model() -> str:
    """`family F model M` from /proc/cpuinfo (a VM's model name often hides the generation: AMD
    family 25 model 1 is Zen 3, model 17 Zen 4), or empty."""
    family, model = _cpuinfo_field("cpu family"), _cpuinfo_field("model")
    return f"family {family} model {model}" if family else ""


def missing_flags(level: str) -> list[str]:
    """The CPU flags that kernel ISA `level` needs and this CPU lacks (empty: it runs here)."""
    if level == "portable":
        return []
    if not is_x86():
        return [f"an x86-64 CPU (this one is {machine()})"]
    return [flag for flag in ISA_FLAGS[level] if flag not in cpu_flags()]


def runnable_isa_levels() -> tuple[str, ...]:
    """The kernel ISA levels this CPU executes, best first (`portable` always)."""
    return tuple(level for level in ISA_LEVELS if not missing_flags(level))


def best_isa_level() -> str:
    return runnable_isa_levels()[0]


def torch_cpu_capability() -> str:
    """torch's own pick for its vectorised CPU kernels (`AVX512`, `AVX2`, `DEFAULT`, ...)."""
    try:
        return str(torch.backends.cpu.get_cpu_capability())
    except (AttributeError, RuntimeError):
        return "unknown"


@functools.cache
def onednn_packing(dtype: torch.dtype) -> tuple[bool, str]:
    """Whether oneDNN packs and multiplies `dtype` weights on this CPU, and if not, why.

    Asked of oneDNN with a tiny packed matmul: on CPUs without AVX-512 (and without AVX-NE-CONVERT)
    it refuses bfloat16 packing at run time although the build has the op, so availability of the
    op alone says nothing."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise")):  # fmt: skip
        return False, "this torch build has no oneDNN packed-linear ops"
    if dtype not in (torch.float32, torch.bfloat16):
        return False, f"oneDNN packed linears take float32 or bfloat16 weights, not {dtype}"
    weight = torch.arange(64, dtype=torch.float32).reshape(8, 8).div(64).to(dtype)
    x = torch.ones(2, 8, dtype=dtype)
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight)
        out = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    except RuntimeError as exc:
        return False, str(exc).strip().splitlines()[0]
    want = torch.nn.functional.linear(x.float(), weight.float())
    if not torch.allclose(out.float(), want, rtol=1e-2, atol=1e-2):
        return False, "oneDNN's packed matmul gave a wrong result in the start-up probe"
    return True, "ok"


def env_overrides() -> dict[str, str]:
    """The environment variables that change which CPU code paths run (for bug reports)."""
    names = ("INFLIGHT_KERNEL_ISA", "INFLIGHT_NATIVE_KERNELS", "INFLIGHT_KERNEL_CACHE", "ATEN_CPU_CAPABILITY",
             "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS", "OMP_NUM_THREADS",
             "LD_PRELOAD", "CC")  # fmt: skip
    return {name: os.environ[name] for name in names if name in os.environ}
