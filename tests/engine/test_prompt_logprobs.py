"""Prompt logprobs (`SamplingParams.prompt_logprobs`) equal transformers' log_softmax of the prompt's
logits in float32 (within a small multiple of what transformers itself moves by on the prompt: in
float64, on another thread count; `tests/tolerance.py`): across prefill chunks, beside a cached prefix,
through preemption, with top-k."""

from __future__ import annotations

import copy
import random
from functools import cache

import pytest
import torch
from tolerance import assert_close_to_reference, other_thread_count

from inflight.engine import EngineConfig, LLMEngine, SamplingParams


def _prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 380) for _ in range(n)]


def _hf_logprobs(hf, prompt: list[int]) -> torch.Tensor:
    """transformers: log_softmax of the logits at each prompt position but the last, float32 (float64
    for a float64 model)."""
    with torch.no_grad():
        logits = hf(torch.tensor([prompt])).logits[0, :-1]
        return torch.log_softmax(logits if logits.dtype == torch.float64 else logits.float(), -1)


@cache
def _hf_float64(hf) -> torch.nn.Module:
    return copy.deepcopy(hf).double()


def _check(out, hf, prompt: list[int], k: int = 0) -> None:
    assert out.prompt_token_ids == prompt
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    logprobs = _hf_logprobs(hf, prompt)
    with other_thread_count():
        variants = [_hf_logprobs(_hf_float64(hf), prompt), _hf_logprobs(hf, prompt)]
    targets = torch.tensor(prompt[1:])[:, None]
    expected = logprobs.gather(1, targets).squeeze(1)
    got = torch.tensor(out.prompt_logprobs[1:])
    assert_close_to_reference(
        got, expected, [v.gather(1, targets).squeeze(1) for v in variants], "prompt logprobs"
    )
    ranks = (logprobs > expected[:, None]).sum(-1) + 1
    assert out.prompt_logprob_ranks == [None, *ranks.tolist()]
    if not k:
        assert out.prompt_top_logprobs is None
        return
    assert out.prompt_top_logprobs[0] is None and len(out.prompt_top_logprobs) == len(prompt)
    hf_ids = torch.topk(logprobs, k).indices
    assert [[t for t, _ in entry] for entry in out.prompt_top_logprobs[1:]] == hf_ids.tolist()
    values = torch.tensor([[v for _, v in entry] for entry in out.prompt_top_logprobs[1:]])
    assert_close_to_reference(values, logprobs.gather(1, hf_ids), [v.gather(1, hf_ids) for v in variants],
                              "top logprobs")


@pytest.fixture(scope="module")
def hf(tiny_model_factory, hf_model_factory):
    return hf_model_factory(tiny_model_factory("qwen2"))


def _engine(tiny_model_factory, **overrides) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(tiny_model_factory("qwen2")), block_size=4, **overrides))


def _params(k: int | None, max_tokens: int = 3) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, prompt_logprobs=k)


def test_batch_of_chunked_prompts_with_and_without(tiny_model_factory, hf):
    """A step budget of 16 tokens: the 50-token prompt is scored over four chunks, mixed with
    requests that do not ask (which get None and the same tokens as alone)."""
    engine = _engine(tiny_model_factory, max_num_batched_tokens=16)
    prompts = [_prompt(1, 50), _prompt(2, 9), _prompt(3, 2), _prompt(4, 1), _prompt(5, 23)]
    params = [_params(0), _params(None), _params(3), _params(0), _params(5)]
    outs = engine.generate(prompts, params)
    _check(outs[0], hf, prompts[0])
    assert outs[1].prompt_logprobs is None and outs[1].prompt_top_logprobs is None
    _check(outs[2], hf, prompts[2], k=3)
    assert outs[3].prompt_logprobs == [None]  # one token: nothing to score
    _check(outs[4], hf, prompts[4], k=5)
    alone = LLMEngine(engine.config).generate(prompts, _params(None))
    assert [o.output_token_ids for o in outs] == [o.output_token_ids for o in alone]


def test_cached_prefix_is_not_read_while_scoring(tiny_model_factory, hf):
    """A prompt sharing a cached prefix is computed from its first token (cached KV has no logits);
    its blocks are still published, and a later request without prompt logprobs hits them."""
    engine = _engine(tiny_model_factory)
    shared = _prompt(6, 30)
    first, scored, after = shared + _prompt(7, 5), shared + _prompt(8, 6), shared + _prompt(9, 3)
    engine.generate([first], _params(None))
    out = engine.generate([scored], _params(2))[0]
    assert out.num_cached_tokens == 0
    _check(out, hf, scored, k=2)
    later = engine.generate([after], _params(None))[0]
    assert later.num_cached_tokens >= 28


def test_scores_survive_preemption(tiny_model_factory, hf):
    """19 KV blocks of 4 tokens: requests preempt each other (recompute) mid-prefill and mid-decode;
    every prompt position keeps its score."""
    engine = _engine(tiny_model_factory, num_kv_blocks=19, max_num_batched_tokens=12)
    prompts = [_prompt(10 + i, n) for i, n in enumerate([40, 33, 21])]
    outs = engine.generate(prompts, _params(0, max_tokens=24))
    assert engine.stats.preemptions > 0
    for out, prompt in zip(outs, prompts, strict=True):
        _check(out, hf, prompt)


def test_bad_values_are_refused():
    for bad in (-1, True, 1.5):
        with pytest.raises(Exception, match="prompt_logprobs"):
            SamplingParams(prompt_logprobs=bad).validate()
