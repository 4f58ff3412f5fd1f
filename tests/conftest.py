"""Shared fixtures: tiny locally-built HF models (built once per session) and transformers oracles."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

torch.set_num_threads(int(os.environ.get("INFLIGHT_TEST_THREADS", "1")))


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

