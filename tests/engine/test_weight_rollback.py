"""A failed weight update can be rolled back: generation resumes on the old weights, bit-exactly."""

from __future__ import annotations

import pytest
import torch

from inflight.engine import EngineConfig, EngineStateError, LLMEngine, SamplingParams, WeightUpdateError
from inflight.engine.models.loader import iter_safetensors
from inflight.testing.oracle import hf_greedy

PROMPTS = [[5, 6, 7, 8, 9], list(range(20, 47))]
PARAMS = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)


def _run_partially(engine: LLMEngine, steps: int) -> None:
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, PARAMS)
    for _ in range(steps):
        engine.step()


def _finish(engine: LLMEngine) -> dict:
    outs = {}
    while engine.has_unfinished_requests():
        outs.update((o.request_id, o) for o in engine.step())
    return outs


def test_failed_update_rolls_back_to_old_weights(tiny_model_factory, hf_model_factory):
    model_a, model_b = tiny_model_factory("qwen2", seed=0), tiny_model_factory("qwen2", seed=1)
    engine = LLMEngine(EngineConfig(model=str(model_a), block_size=4))
    before = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    _run_partially(engine, steps=6)
    engine.pause("keep")
    engine.begin_weight_update()
    weights_b = list(iter_safetensors(model_b))
    engine.load_weights(weights_b[: len(weights_b) // 2])  # half of B lands...
    name, tensor = weights_b[-1]
    with pytest.raises(WeightUpdateError, match="expected"):
        engine.load_weights([(name, tensor[:1])])  # ...then a chunk with a wrong shape
    with pytest.raises(EngineStateError):
        engine.resume()
    engine.begin_weight_update()  # restarting the update keeps the original weights to roll back to
    engine.load_weights(weights_b[:3])
    assert engine.abort_weight_update() is True
    assert all(torch.equal(p, before[n]) for n, p in engine.model.named_parameters())
    engine.resume()
    outs = _finish(engine)
    assert engine.weight_version == 0
    hf_a = hf_model_factory(model_a)
    for i, prompt in enumerate(PROMPTS):
        assert outs[f"r{i}"].output_token_ids == hf_greedy(hf_a, prompt, 20)[0]
        assert set(outs[f"r{i}"].token_weight_versions) == {0}


def test_no_rollback_after_sleep(tiny_model_factory):
    engine = LLMEngine(EngineConfig(model=str(tiny_model_factory("qwen2")), block_size=4))
    engine.sleep(offload_kv=False)
    engine.wake_up()
    engine.begin_weight_update()
    assert engine.abort_weight_update() is False  # the old weights were dropped by sleep
    with pytest.raises(EngineStateError, match="incomplete weights"):
        engine.resume()
