"""Sampling: seeds are reproducible regardless of the batch; filters behave as their definitions; logprobs
and top logprobs are torch.log_softmax of the temperature-scaled logits."""

from __future__ import annotations

import random

import pytest
import torch

from inflight.engine import EngineConfig, LLMEngine, SamplingParams
from inflight.engine.errors import InvalidRequestError
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
        (token,), _, _ = sample(logits, [params], [None], gen)
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
    (token,), (logprob,), _ = sample(logits, [params], [None], gen)
    assert abs(logprob - torch.log_softmax(logits[0] / 0.5, -1)[token].item()) < 1e-6
    greedy = SamplingParams(temperature=0.0)
    (token,), (logprob,), _ = sample(logits, [greedy], [None], gen)
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
    tokens, lps, tops = sample(logits, params, gens, torch.Generator().manual_seed(0))
    assert lps[1] is None and lps[3] is None and tops == [None] * 4
    for row, temp in ((0, 1.0), (2, 0.5)):
        want = torch.log_softmax(logits[row] / temp, dim=-1)[tokens[row]].item()
        assert abs(lps[row] - want) < 1e-5
    none_wanted = sample(logits[:1], [params[1]], [None], torch.Generator())
    assert none_wanted == ([tokens[0]], [None], [None])


def test_request_without_logprobs_returns_none(tiny_model_factory):
    engine = LLMEngine(EngineConfig(model=str(tiny_model_factory("qwen2")), block_size=4))
    plain, with_lp = engine.generate(
        [[5, 6, 7], [5, 6, 7]],
        [SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=False),
         SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)],
    )  # fmt: skip
    assert plain.logprobs is None and plain.output_token_ids == with_lp.output_token_ids
    assert len(with_lp.logprobs) == 4 and all(isinstance(lp, float) for lp in with_lp.logprobs)


def test_top_logprobs_are_the_top_k_of_the_scaled_log_softmax():
    """Rows asking for k alternatives get the k largest entries of log_softmax(logits / T), most likely
    first; the sampled token's logprob is bit for bit its entry there; other rows pay nothing."""
    torch.manual_seed(5)
    logits = torch.randn(4, 64) * 2
    params = [
        SamplingParams(temperature=0.7, seed=3, top_k=5, top_logprobs=3),
        SamplingParams(temperature=0.0, top_logprobs=5),
        SamplingParams(temperature=1.3),
        SamplingParams(temperature=0.0, top_logprobs=1),
    ]
    gens = [torch.Generator().manual_seed(3), None, None, None]
    tokens, lps, tops = sample(logits, params, gens, torch.Generator().manual_seed(0))
    assert tops[2] is None and lps[2] is not None
    for row, temp, k in [(0, 0.7, 3), (1, 1.0, 5), (3, 1.0, 1)]:
        want = torch.log_softmax(logits[row] / temp, dim=-1)
        values, ids = want.topk(k)
        assert [t for t, _ in tops[row]] == ids.tolist()
        assert [lp for _, lp in tops[row]] == pytest.approx(values.tolist(), abs=1e-6)
        by_id = dict(tops[row])
        if tokens[row] in by_id:
            assert by_id[tokens[row]] == lps[row]
    assert tops[1][0] == (tokens[1], lps[1]) and tops[3] == [(tokens[3], lps[3])]  # greedy: top-1 is it


def test_top_logprobs_validation():
    with pytest.raises(InvalidRequestError, match="top_logprobs"):
        SamplingParams(top_logprobs=-1).validate()
    with pytest.raises(InvalidRequestError, match="needs logprobs=True"):
        SamplingParams(top_logprobs=2, logprobs=False).validate()


def test_engine_records_top_logprobs_per_token(tiny_model_factory, hf_model_factory):
    """Through the engine: k alternatives per output token, equal to transformers' log_softmax."""
    model_dir = tiny_model_factory("qwen2")
    engine = LLMEngine(EngineConfig(model=str(model_dir), block_size=4))
    prompt = [5, 6, 7, 8]
    out, plain = engine.generate(
        [prompt, prompt],
        [SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, top_logprobs=4),
         SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)],
    )  # fmt: skip
    assert plain.top_logprobs is None and len(out.top_logprobs) == 5
    with pytest.raises(InvalidRequestError, match="vocabulary"):
        engine.add_request("too-many", prompt, SamplingParams(top_logprobs=engine.vocab_size + 1))
    hf = hf_model_factory(model_dir)
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + out.output_token_ids])).logits[0, len(prompt) - 1 : -1]
    want = torch.log_softmax(logits.float(), dim=-1).topk(4)
    for step, alternatives in enumerate(out.top_logprobs):
        assert [t for t, _ in alternatives] == want.indices[step].tolist()
        assert [lp for _, lp in alternatives] == pytest.approx(want.values[step].tolist(), abs=1e-4)
        assert alternatives[0] == (out.output_token_ids[step], out.logprobs[step])


@pytest.mark.parametrize("temperature", [1e-300, 5e-324, 1e-6])
def test_a_temperature_too_small_to_divide_by_is_greedy(tiny_model_factory, hf_model_factory, temperature):
    """Dividing logits by 1e-300 overflows to inf and softmax to NaN; below GREEDY_BELOW the engine
    samples greedily, and the logprobs are transformers' unscaled log_softmax, as for 0."""
    model_dir = tiny_model_factory("qwen2")
    engine = LLMEngine(EngineConfig(model=str(model_dir), block_size=4))
    prompt = [5, 6, 7]
    (tiny,) = engine.generate(
        [prompt], SamplingParams(max_tokens=6, temperature=temperature, ignore_eos=True)
    )
    hf = hf_model_factory(model_dir)
    ids = torch.tensor([prompt + tiny.output_token_ids])
    with torch.no_grad():
        logits = hf(ids).logits[0, len(prompt) - 1:-1].float()
    assert tiny.output_token_ids == logits.argmax(-1).tolist()
    expected = (
        torch.log_softmax(logits, -1).gather(1, torch.tensor(tiny.output_token_ids)[:, None]).squeeze(1)
    )
    assert all(torch.isfinite(torch.tensor(tiny.logprobs)))
    torch.testing.assert_close(torch.tensor(tiny.logprobs), expected, atol=1e-4, rtol=0)


def test_the_trainer_scales_logits_by_the_temperature_the_engine_used():
    from inflight.engine.request import GREEDY_BELOW, scaling_temperature
    from inflight.train.losses import token_logprobs

    assert scaling_temperature(0.0) == scaling_temperature(1e-300) == 1.0 and scaling_temperature(0.7) == 0.7
    assert scaling_temperature(GREEDY_BELOW) == GREEDY_BELOW
    logits = torch.randn(1, 4, 11)
    ids = torch.randint(0, 11, (1, 4))
    assert torch.isfinite(token_logprobs(logits, ids, temperature=1e-300)).all()
    torch.testing.assert_close(token_logprobs(logits, ids, 1e-300), token_logprobs(logits, ids, 0.0))
