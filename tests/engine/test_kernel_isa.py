"""Kernel ISA levels: each level this CPU runs builds its own code paths, `native` picks the best,
a level the CPU cannot run is refused naming what is missing, and the portable C builds for aarch64."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from inflight.engine import EngineConfig, LLMEngine, cpu, kernels

ZEN3_FLAGS = frozenset("fpu sse sse2 ssse3 sse4_1 sse4_2 avx avx2 fma f16c bmi1 bmi2 movbe".split())


@pytest.fixture(autouse=True)
def native_kernels_on(monkeypatch):
    """These tests are of the loader itself: they run even where INFLIGHT_NATIVE_KERNELS=0 turns the
    kernels off for the rest of the suite."""
    monkeypatch.delenv("INFLIGHT_NATIVE_KERNELS", raising=False)


def test_native_is_the_best_level_this_cpu_runs():
    levels = cpu.runnable_isa_levels()
    assert levels[-1] == "portable" and list(levels) == [lv for lv in cpu.ISA_LEVELS if lv in levels]
    assert kernels.resolve_isa("native") == levels[0]


def test_each_level_builds_a_library_of_its_own_code_paths(kernel_isa):
    lib = kernels.load(required=True, isa=kernel_isa)
    assert kernels.loaded_isa(lib) == kernel_isa
    assert kernels.library_path(kernel_isa).name.startswith(f"inflight_kernels-{kernel_isa}-")
    others = {kernels.library_path(level) for level in cpu.runnable_isa_levels() if level != kernel_isa}
    assert kernels.library_path(kernel_isa) not in others


def test_a_level_this_cpu_cannot_run_is_refused_naming_the_missing_features(monkeypatch, tiny_model_factory):
    """On an AVX2-only CPU (Zen 3's flags): native is avx2; asking for avx512 names the missing
    flags and the settings that work, at engine construction too, instead of crashing later."""
    monkeypatch.setattr(cpu, "cpu_flags", lambda: ZEN3_FLAGS)
    monkeypatch.setattr(cpu, "machine", lambda: "x86_64")
    assert cpu.runnable_isa_levels() == ("avx2", "portable")
    assert kernels.resolve_isa("native") == "avx2"
    with pytest.raises(kernels.NativeKernelError, match=r"avx512f, avx512bw.*one of \['avx2', 'portable'\]"):
        kernels.resolve_isa("avx512")
    monkeypatch.setenv("INFLIGHT_KERNEL_ISA", "avx512")
    with pytest.raises(kernels.NativeKernelError, match="INFLIGHT_KERNEL_ISA=avx512 needs CPU features"):
        LLMEngine(EngineConfig(model=str(tiny_model_factory("qwen2"))))


def test_off_x86_only_the_portable_level_runs(monkeypatch):
    monkeypatch.setattr(cpu, "machine", lambda: "aarch64")
    assert cpu.runnable_isa_levels() == ("portable",)
    assert "-march" not in " ".join(kernels.compile_flags("portable", "aarch64"))
    with pytest.raises(kernels.NativeKernelError, match="x86-64 only"):
        kernels.compile_flags("avx2", "aarch64")


def test_an_unknown_isa_names_the_choices(monkeypatch):
    monkeypatch.setenv("INFLIGHT_KERNEL_ISA", "sse9")
    with pytest.raises(
        kernels.NativeKernelError, match=r"INFLIGHT_KERNEL_ISA='sse9' must be one of \['native'"
    ):
        kernels.load()


CROSS_CC = shutil.which("aarch64-linux-gnu-gcc")


@pytest.mark.skipif(
    CROSS_CC is None, reason="no aarch64 cross-compiler (Debian: apt-get install gcc-aarch64-linux-gnu)"
)
def test_portable_kernels_cross_compile_for_aarch64(tmp_path):
    """Apple silicon and Graviton build the portable level: the same flags, an aarch64 shared object,
    and no warning (an x86 intrinsic leaking out of its #if would fail here)."""
    target = tmp_path / "kernels-aarch64.so"
    kernels.build(target, CROSS_CC, [*kernels.compile_flags("portable", "aarch64"), "-Wall", "-Werror"])
    assert target.read_bytes()[:4] == b"\x7fELF" and target.read_bytes()[18] == 183  # e_machine EM_AARCH64
    assert [p.name for p in tmp_path.iterdir()] == [target.name]  # no objects left over


def test_loading_the_kernels_keeps_denormals(tmp_path):
    """The library is built with -ffast-math but not linked with it: GCC's crtfastmath.o would set
    flush-to-zero in the loading thread, and torch's float32 denormals would become 0 (checked in a
    fresh process, since this one has loaded the kernels already)."""
    script = (
        "import torch; from inflight.engine import kernels\n"
        "x = torch.tensor([1e-39]); before = (x * 1.0).item(); kernels.load(required=True)\n"
        "print(before, (x * 1.0).item())"
    )
    env = {**os.environ, "INFLIGHT_KERNEL_CACHE": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr
    before, after = map(float, done.stdout.split())
    assert before > 0 and after == before
