"""One live vLLM server per module (`inflight serve --backend vllm`) on a small fp32 Qwen2 with
head_dim 64 (vLLM's CPU attention has no head_dim 16), and the transformers models it is held to."""

from __future__ import annotations

import pytest
from safetensors.torch import load_file
from vllm_launch import TINY, TOKEN, VllmServer, launch, vllm_python_or_skip


@pytest.fixture(scope="module")
def vllm_server(tmp_path_factory, tiny_model_factory, hf_model_factory):
    """`python -m inflight.server --backend vllm` on model A; models A and B (same shapes, other
    seed) with their transformers twins and weights."""
    vllm_python_or_skip()
    models = {"A": tiny_model_factory("qwen2", 0, **TINY), "B": tiny_model_factory("qwen2", 1, **TINY)}
    with launch(models["A"], ["--control-token", TOKEN, "--max-model-len", "1024"]) as (url, log):
        yield VllmServer(url, models, {k: hf_model_factory(v) for k, v in models.items()},
                         {k: load_file(str(v / "model.safetensors")) for k, v in models.items()}, log)
