"""The vLLM backend serves a mixture of experts (Qwen3-MoE) on CPU: greedy tokens and log-probabilities
as transformers', a weight update by the trainer's own names (transformers 5's fused 3-D expert
tensors, what `state_dict()` and a sync send) serves the new weights, and the routing record,
which vLLM 0.32 returns only from its Triton model runner, is refused with the reason."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM
from vllm_launch import launch

from inflight.client import RemoteClient, routes
from inflight.client.base import update_weights
from inflight.engine.request import SamplingParams
from inflight.testing import make_tiny_model

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "engine"))  # the engine tests' oracles
from conftest_weights import hf_continue  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]

TOKEN = "moe-test-control"
# head_dim 64 (vLLM's CPU attention has none smaller); 8 experts, 2 per token
SHAPE = dict(hidden_size=512, num_attention_heads=8, num_key_value_heads=2, num_hidden_layers=2,
             moe_intermediate_size=256)
PROMPTS = [[5, 17, 33, 40, 41], [7, 8, 9, 10, 11, 12, 13, 14, 15], [100, 3, 250]]
TOL = 2e-3  # fp32 sums in other orders (oneDNN / vLLM's fused MoE vs torch), as in test_vllm_server.py


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A vLLM server on Qwen3-MoE A; A and B (other seed) as transformers models."""
    root = tmp_path_factory.mktemp("vllm-moe")
    dirs = {
        tag: make_tiny_model(root / tag, "qwen3_moe", seed, **SHAPE) for tag, seed in (("A", 0), ("B", 1))
    }
    hf = {tag: AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval() for tag, d in dirs.items()}
    with launch(dirs["A"], ["--control-token", TOKEN, "--max-model-len", "256"]) as (url, _):
        yield url, hf


def _greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **kw)


def _check(model, prompt: list[int], out) -> None:
    assert out.output_token_ids == hf_continue(model, model, prompt, 0, len(out.output_token_ids))
    with torch.no_grad():
        logits = model(torch.tensor([prompt + out.output_token_ids])).logits[0, len(prompt) - 1 : -1]
    ref = torch.log_softmax(logits, -1).gather(1, torch.tensor(out.output_token_ids)[:, None])[:, 0]
    assert torch.allclose(torch.tensor(out.logprobs), ref, atol=TOL), (out.logprobs[:4], ref[:4])


def test_serves_an_moe_and_takes_the_trainers_fused_expert_names(served):
    url, hf = served
    trainer_names = dict(hf["B"].state_dict())
    assert "model.layers.0.mlp.experts.gate_up_proj" in trainer_names  # transformers 5's fused experts

    async def go():
        client = RemoteClient(url, control_token=TOKEN, health_check_interval_s=None)
        try:
            on_a = await asyncio.gather(*(client.generate(p, _greedy(12)) for p in PROMPTS))
            version = await update_weights(client, list(trainer_names.items()))
            on_b = await asyncio.gather(*(client.generate(p, _greedy(12)) for p in PROMPTS))
            return on_a, version, on_b
        finally:
            await client.close()

    on_a, version, on_b = asyncio.run(go())
    for prompt, a, b in zip(PROMPTS, on_a, on_b, strict=True):
        _check(hf["A"], prompt, a)
        _check(hf["B"], prompt, b)
        assert b.token_weight_versions == [version] * 12
    assert [o.output_token_ids for o in on_a] != [o.output_token_ids for o in on_b]


def test_the_routing_record_is_refused_with_the_reason(served):
    url, _ = served
    body = {
        "prompt_token_ids": PROMPTS[0],
        "sampling_params": {"max_tokens": 2, "return_routed_experts": True},
    }
    response = httpx.post(url + routes.GENERATE, json=body, timeout=30)
    assert response.status_code == 400 and "Model Runner V2" in response.text and "Triton" in response.text
