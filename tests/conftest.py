"""Shared fixtures: tiny locally-built HF models (built once per session) and transformers oracles."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

torch.set_num_threads(int(os.environ.get("INFLIGHT_TEST_THREADS", "1")))


def pytest_addoption(parser):
    parser.addoption("--device", default="cpu", choices=("cpu", "cuda"),
                     help="device of the tests that take the `device` fixture (the vllm-marked ones, the "
                          "device oracle): cpu (default) or cuda")


def pytest_configure(config):
    if config.getoption("--device") == "cuda" and not torch.cuda.is_available():
        raise pytest.UsageError(f"--device cuda: this torch ({torch.__version__}) sees no CUDA device")


@pytest.fixture(scope="session")
def device(request) -> str:
    """The device `--device` names (cpu by default)."""
    return request.config.getoption("--device")


def kernel_isa_levels() -> tuple[str, ...]:
    """The kernel ISA levels the tests run at: every level this CPU executes (so an AVX-512 machine
    also proves the AVX2 and portable code), or only the one INFLIGHT_KERNEL_ISA forces."""
    from inflight.engine import cpu, kernels

    forced = kernels.requested_isa()
    return cpu.runnable_isa_levels() if forced == "native" else (kernels.resolve_isa(forced),)


def pytest_generate_tests(metafunc):
    if "kernel_isa" in metafunc.fixturenames:
        metafunc.parametrize("kernel_isa", kernel_isa_levels(), indirect=True)


@pytest.fixture
def kernel_isa(request, monkeypatch) -> str:
    """Runs the test once per kernel ISA level (see kernel_isa_levels) with INFLIGHT_KERNEL_ISA set
    to it: every engine the test builds loads that level's kernels."""
    monkeypatch.setenv("INFLIGHT_KERNEL_ISA", request.param)
    return request.param


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory):
    """Returns build(arch="qwen2", seed=0, **overrides) -> model dir, cached per argument set."""
    from inflight.testing import make_tiny_model

    cache: dict[tuple, Path] = {}

    def build(arch: str = "qwen2", seed: int = 0, **overrides) -> Path:
        key = (arch, seed, tuple(sorted(overrides.items())))
        if key not in cache:
            name = f"{arch}-s{seed}-" + "-".join(f"{k}{v}" for k, v in sorted(overrides.items()))
            cache[key] = make_tiny_model(tmp_path_factory.mktemp(name), arch, seed, **overrides)
        return cache[key]

    return build


@pytest.fixture(scope="session")
def hf_model_factory():
    """Returns load(model_dir, dtype=torch.float32) -> a transformers model in eval mode, cached."""
    from transformers import AutoModelForCausalLM

    cache: dict[tuple, torch.nn.Module] = {}

    def load(model_dir: Path, dtype: torch.dtype = torch.float32):
        key = (str(model_dir), dtype)
        if key not in cache:
            cache[key] = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
        return cache[key]

    return load

