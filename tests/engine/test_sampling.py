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
