"""Sampling: seeds are reproducible regardless of the batch; filters behave as their definitions."""

from __future__ import annotations

import random

import torch

from inflight.engine import EngineConfig, LLMEngine, SamplingParams
from inflight.engine.sampler import sample


def _run(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, list[int]]:
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, prompt, params)
    outs = {}
    while engine.has_unfinished_requests():
        outs.update((o.request_id, o.output_token_ids) for o in engine.step())
    return outs


def test_seeded_sampling_independent_of_batch(tiny_model_factory):
    engine = LLMEngine(EngineConfig(model=str(tiny_model_factory("qwen2")), block_size=4))
    rng = random.Random(0)
    prompt = [rng.randrange(3, 380) for _ in range(9)]
    seeded = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)
    alone = _run(engine, {"x": (prompt, seeded)})["x"]
    others = {
        f"o{i}": ([rng.randrange(3, 380) for _ in range(rng.randint(1, 30))],
                  SamplingParams(max_tokens=rng.randint(1, 20), temperature=1.0, ignore_eos=True))
        for i in range(5)
    }
    crowded = _run(engine, {**others, "x": (prompt, seeded)})["x"]
    assert crowded == alone
    other_seed = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, top_k=50, seed=99, ignore_eos=True)
    assert _run(engine, {"y": (prompt, other_seed)})["y"] != alone


def test_sampling_follows_the_distribution():
    torch.manual_seed(0)
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=1.0)
    counts = torch.zeros(4)
    for _ in range(4000):
        (token,), _ = sample(logits, [params], [None], gen)
        counts[token] += 1
    expected = logits.softmax(-1)[0] * 4000
    assert torch.allclose(counts, expected, atol=4 * expected.sqrt().max())


def test_top_k_and_top_p_restrict_support():
    logits = torch.tensor([[3.0, 2.5, 0.0, -1.0, -2.0]])
    gen = torch.Generator().manual_seed(0)
    top_k = SamplingParams(temperature=1.0, top_k=2)
    top_p = SamplingParams(temperature=1.0, top_p=0.5)  # the top token alone has ~0.58 of the mass
    seen_k = {sample(logits, [top_k], [None], gen)[0][0] for _ in range(300)}
    seen_p = {sample(logits, [top_p], [None], gen)[0][0] for _ in range(300)}
    assert seen_k == {0, 1}
    assert seen_p == {0}


def test_logprob_uses_temperature_scaled_distribution():
    logits = torch.tensor([[1.0, 0.5, -0.5]])
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0.5, seed=None)
    (token,), (logprob,) = sample(logits, [params], [None], gen)
    assert abs(logprob - torch.log_softmax(logits[0] / 0.5, -1)[token].item()) < 1e-6
    greedy = SamplingParams(temperature=0.0)
    (token,), (logprob,) = sample(logits, [greedy], [None], gen)
    assert token == 0 and abs(logprob - torch.log_softmax(logits[0], -1)[0].item()) < 1e-6


def test_logprobs_only_for_the_requests_that_ask():
    """A mixed batch: rows that ask get log_softmax at their token (temperature-scaled), the rest None."""
    torch.manual_seed(3)
    logits = torch.randn(4, 50) * 3
    params = [
        SamplingParams(temperature=0.0, logprobs=True),
        SamplingParams(temperature=0.0, logprobs=False),
        SamplingParams(temperature=0.5, seed=1, logprobs=True),
        SamplingParams(temperature=0.0, logprobs=False),
    ]
    gens = [None, None, torch.Generator().manual_seed(1), None]
    tokens, lps = sample(logits, params, gens, torch.Generator().manual_seed(0))
    assert lps[1] is None and lps[3] is None
    for row, temp in ((0, 1.0), (2, 0.5)):
        want = torch.log_softmax(logits[row] / temp, dim=-1)[tokens[row]].item()
        assert abs(lps[row] - want) < 1e-5
    none_wanted = sample(logits[:1], [params[1]], [None], torch.Generator())
    assert none_wanted == ([tokens[0]], [None])


def test_request_without_logprobs_returns_none(tiny_model_factory):
    engine = LLMEngine(EngineConfig(model=str(tiny_model_factory("qwen2")), block_size=4))
    plain, with_lp = engine.generate(
        [[5, 6, 7], [5, 6, 7]],
        [SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=False),
         SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)],
    )  # fmt: skip
    assert plain.logprobs is None and plain.output_token_ids == with_lp.output_token_ids
    assert len(with_lp.logprobs) == 4 and all(isinstance(lp, float) for lp in with_lp.logprobs)
