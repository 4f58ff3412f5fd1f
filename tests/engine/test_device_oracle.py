"""The engine on `--device` (cpu by default; `pytest --device cuda` on a GPU machine) equals
transformers run on the CPU in float32: greedy tokens, logprobs within the device's tolerance.
The PyTorch paths only: the native kernels are CPU code (tested per ISA in test_generate_oracle)."""

from __future__ import annotations

import random

import pytest
import torch

from inflight.engine import EngineConfig, LLMEngine, SamplingParams
from inflight.testing.oracle import hf_greedy

ATOL = {"cpu": 1e-4, "cuda": 2e-3}  # CUDA: other reduction orders (and kernels) than the CPU's, float32


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "llama", "qwen3_moe", "qwen2_moe"])
def test_greedy_on_the_device_matches_transformers(arch, device, tiny_model_factory, hf_model_factory):
    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
    model_dir = tiny_model_factory(arch)
    engine = LLMEngine(
        EngineConfig(
            model=str(model_dir),
            device=device,
            block_size=8,
            num_kv_blocks=64,
            attention_backend="torch",
            linear_backend="torch",
            elementwise_backend="torch",
        )
    )
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 380) for _ in range(n)] for n in (1, 9, 30)]
    outputs = engine.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    hf = hf_model_factory(model_dir)
    for prompt, out in zip(prompts, outputs, strict=True):
        tokens, logprobs = hf_greedy(hf, prompt, 12)
        assert out.output_token_ids == tokens
        assert max(abs(a - b) for a, b in zip(out.logprobs, logprobs, strict=True)) < ATOL[device]
