"""Engine generation equals transformers generate(): batching, prefix hits, chunked prefill, preemption."""

from __future__ import annotations

import os
import random

import pytest
import torch

from inflight.engine import EngineConfig, LLMEngine, SamplingParams, kernels
from inflight.engine.models.linear import resolve_linear_backend
from inflight.testing.oracle import hf_greedy

PROMPT_LENS = [1, 7, 16, 33, 50]
MAX_TOKENS = 24


def _prompts(seed: int, lens=PROMPT_LENS, vocab: int = 380) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lens]


def _greedy(max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def _check_against_hf(hf, prompts, outputs, max_tokens=MAX_TOKENS, atol=1e-4):
    for prompt, out in zip(prompts, outputs, strict=True):
        tokens, logprobs = hf_greedy(hf, prompt, max_tokens)
        assert out.output_token_ids == tokens, f"prompt of {len(prompt)} tokens diverged"
        assert out.finish_reason == "length"
        assert torch.allclose(torch.tensor(out.logprobs), torch.tensor(logprobs), atol=atol, rtol=0)


def _batched_greedy_case(arch, backend, linear, tiny_model_factory, hf_model_factory) -> LLMEngine:
    model_dir = tiny_model_factory(arch)
    config = EngineConfig(model=str(model_dir), block_size=8, attention_backend=backend,
                          linear_backend=linear, elementwise_backend=backend)  # fmt: skip
    engine = LLMEngine(config)
    prompts = _prompts(1)
    outputs = engine.generate(prompts, _greedy())
    _check_against_hf(hf_model_factory(model_dir), prompts, outputs)
    assert all(v == 0 for out in outputs for v in out.token_weight_versions)
    return engine


@pytest.mark.skipif(os.environ.get("INFLIGHT_NATIVE_KERNELS") == "0", reason="INFLIGHT_NATIVE_KERNELS=0")
@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "llama"])
def test_batched_greedy_matches_transformers_native(arch, kernel_isa, tiny_model_factory, hf_model_factory):
    """Every native path (fused kernels, packed linears) at every kernel ISA level this CPU runs:
    token for token, logprobs within 1e-4."""
    engine = _batched_greedy_case(arch, "native", "onednn", tiny_model_factory, hf_model_factory)
    assert kernels.loaded_isa(engine.runner.native_lib) == kernel_isa
    assert kernels.loaded_isa(engine.model.ops.lib) == kernel_isa


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "llama"])
def test_batched_greedy_matches_transformers_torch(arch, tiny_model_factory, hf_model_factory):
    """Every PyTorch path."""
    _batched_greedy_case(arch, "torch", "torch", tiny_model_factory, hf_model_factory)


def test_tied_embeddings_match_transformers(tiny_model_factory, hf_model_factory):
    model_dir = tiny_model_factory("qwen2", seed=3, tie_word_embeddings=True)
    engine = LLMEngine(EngineConfig(model=str(model_dir), block_size=8))
    prompts = _prompts(2, lens=[5, 20])
    _check_against_hf(hf_model_factory(model_dir), prompts, engine.generate(prompts, _greedy()))


def test_prefix_cache_hits_do_not_change_outputs(tiny_model_factory, hf_model_factory):
    model_dir = tiny_model_factory("qwen2")
    engine = LLMEngine(EngineConfig(model=str(model_dir), block_size=4))
    shared = _prompts(3, lens=[30])[0]
    tails = _prompts(4, lens=[1, 5, 9, 14])
    prompts = [shared + tail for tail in tails]
    first = engine.generate(prompts[:1], _greedy())
    rest = engine.generate(prompts[1:], _greedy())
    assert engine.stats.prefix_cache_hit_tokens >= 3 * 28
    assert all(out.num_cached_tokens >= 28 for out in rest)
    _check_against_hf(hf_model_factory(model_dir), prompts, first + rest)
    again = engine.generate(prompts[:1], _greedy())  # a repeat hits the blocks of its own output too
    assert again[0].num_cached_tokens >= 28
    assert again[0].output_token_ids == first[0].output_token_ids


def test_cache_salt_isolates_prefixes(tiny_model_factory):
    engine = LLMEngine(EngineConfig(model=str(tiny_model_factory("qwen2")), block_size=4))
    prompt = _prompts(5, lens=[20])[0]
    engine.add_request("a", prompt, _greedy(2), cache_salt="alice")
    while engine.has_unfinished_requests():
        engine.step()
    engine.add_request("b", prompt, _greedy(2), cache_salt="bob")
    engine.add_request("c", prompt, _greedy(2), cache_salt="alice")
    outs = {}
    while engine.has_unfinished_requests():
        outs.update((o.request_id, o) for o in engine.step())
    assert outs["b"].num_cached_tokens == 0
    assert outs["c"].num_cached_tokens == 16
    assert outs["b"].output_token_ids == outs["c"].output_token_ids


def test_chunked_prefill_small_budget(tiny_model_factory, hf_model_factory):
    model_dir = tiny_model_factory("qwen3")
    engine = LLMEngine(EngineConfig(model=str(model_dir), block_size=4, max_num_batched_tokens=6))
    prompts = _prompts(6)
    outputs = engine.generate(prompts, _greedy())
    _check_against_hf(hf_model_factory(model_dir), prompts, outputs)


def test_preemption_by_recompute(tiny_model_factory, hf_model_factory):
    model_dir = tiny_model_factory("llama")
    # 19 blocks of 4 tokens: the longest request (50 + 24) needs 19 alone, so requests preempt
    engine = LLMEngine(EngineConfig(model=str(model_dir), block_size=4, num_kv_blocks=19))
    prompts = _prompts(7)
    outputs = engine.generate(prompts, _greedy())
    assert engine.stats.preemptions > 0
    assert sum(out.num_recomputed_tokens for out in outputs) > 0
    _check_against_hf(hf_model_factory(model_dir), prompts, outputs)
    assert engine.pool.num_free == engine.pool.num_blocks


def _linear_backends_for(dtype: torch.dtype) -> list:
    """Every linear backend that runs `dtype` weights here; the rest skipped, saying why."""
    backends = []
    for name in ("onednn", "onednn_fp32", "torch"):
        try:
            resolve_linear_backend(name, dtype, torch.device("cpu"))
        except ValueError as exc:
            backends.append(pytest.param(name, marks=pytest.mark.skip(reason=f"not on this CPU: {exc}")))
        else:
            backends.append(name)
    return backends


@pytest.mark.parametrize("linear", _linear_backends_for(torch.bfloat16))
def test_bfloat16_close_to_transformers(linear, kernel_isa, tiny_model_factory, hf_model_factory):
    model_dir = tiny_model_factory("qwen2")
    engine = LLMEngine(
        EngineConfig(model=str(model_dir), dtype="bfloat16", block_size=8, linear_backend=linear)
    )
    prompts = _prompts(8, lens=[6, 25])
    outputs = engine.generate(prompts, _greedy(1))
    hf = hf_model_factory(model_dir, torch.bfloat16)
    for prompt, out in zip(prompts, outputs, strict=True):
        with torch.no_grad():
            logits = hf(torch.tensor([prompt])).logits[0, -1].float()
        reference = torch.log_softmax(logits, -1)[out.output_token_ids[0]].item()
        assert abs(out.logprobs[0] - reference) < 0.1
        assert reference > logits.log_softmax(-1).max().item() - 0.1  # the engine's pick is (near) the top


def test_stop_tokens_and_eos(tiny_model_factory, hf_model_factory):
    model_dir = tiny_model_factory("qwen2")
    engine = LLMEngine(EngineConfig(model=str(model_dir), block_size=8))
    prompt = _prompts(9, lens=[12])[0]
    full = engine.generate([prompt], _greedy(12))[0]
    stop = full.output_token_ids[5]
    first = full.output_token_ids.index(stop)
    stopped = engine.generate([prompt], SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[stop]))[
        0
    ]
    assert stopped.finish_reason == "stop"
    assert stopped.output_token_ids == full.output_token_ids[: first + 1]
