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


def test_abort_without_a_rollback_copy(tiny_model_factory):
    """With weight_update_rollback off, an abandoned update that overwrote nothing leaves the engine
    running on its weights; one that overwrote parameters in place leaves it unable to run."""
    model_a, model_b = tiny_model_factory("qwen2", seed=0), tiny_model_factory("qwen2", seed=1)
    engine = LLMEngine(EngineConfig(model=str(model_a), block_size=4, weight_update_rollback=False))
    engine.begin_weight_update()
    assert engine.status().update == "open" and not engine.status().can_roll_back
    assert engine.abort_weight_update() is False
    assert engine.status().update == "none" and engine.can_run
    engine.begin_weight_update()
    engine.load_weights(list(iter_safetensors(model_b))[:3])
    assert engine.abort_weight_update() is False
    assert engine.status().update == "invalid" and not engine.can_run
    with pytest.raises(EngineStateError, match="incomplete weights"):
        engine.resume()
    engine.begin_weight_update()
    engine.load_weights(iter_safetensors(model_b))
    assert engine.finish_weight_update() == 1 and engine.status().update == "none" and engine.can_run


def test_a_failed_finish_keeps_the_rollback_copy(tiny_model_factory):
    engine = LLMEngine(EngineConfig(model=str(tiny_model_factory("qwen2")), block_size=4))
    engine.begin_weight_update()
    with pytest.raises(WeightUpdateError, match="missing"):
        engine.finish_weight_update()
    status = engine.status()
    assert (status.update, status.can_roll_back, status.can_run) == ("invalid", True, False)
    assert engine.abort_weight_update() is True and engine.can_run and engine.weight_version == 0


def _storages(engine: LLMEngine) -> dict[str, int]:
    return {n: p.data_ptr() for n, p in engine.model.named_parameters()}


def _full_update(engine: LLMEngine, weights: list) -> None:
    engine.begin_weight_update()
    engine.load_weights(weights)
    engine.finish_weight_update()


def test_updates_write_into_the_storage_the_last_one_replaced(tiny_model_factory, hf_model_factory):
    """Double-buffered weights: from the second update on, nothing is allocated (a fresh buffer
    page faults at a fraction of memcpy's speed); an aborted update's buffers are reused too, and
    every update still lands (transformers on the last model loaded)."""
    model_a, model_b = tiny_model_factory("qwen2", seed=0), tiny_model_factory("qwen2", seed=1)
    engine = LLMEngine(EngineConfig(model=str(model_a), block_size=4))
    weights_a, weights_b = list(iter_safetensors(model_a)), list(iter_safetensors(model_b))
    first = _storages(engine)
    _full_update(engine, weights_b)
    second = _storages(engine)
    assert all(second[n] != first[n] for n in first)  # rollback needed another buffer once
    _full_update(engine, weights_a)
    assert _storages(engine) == first  # ...and from then on the two alternate
    engine.begin_weight_update()
    engine.load_weights(weights_b)
    assert _storages(engine) == second
    assert engine.abort_weight_update() is True
    assert _storages(engine) == first
    _full_update(engine, weights_b)  # into the buffers the abandoned update had written
    assert _storages(engine) == second
    hf_b = hf_model_factory(model_b)
    outs = engine.generate(PROMPTS, PARAMS)
    for out, prompt in zip(outs, PROMPTS, strict=True):
        assert out.output_token_ids == hf_greedy(hf_b, prompt, 20)[0]


def test_sleep_drops_the_spare_weights(tiny_model_factory):
    model = tiny_model_factory("qwen2")
    engine = LLMEngine(EngineConfig(model=str(model), block_size=4))
    _full_update(engine, list(iter_safetensors(model)))
    assert engine._spare_weights  # the replaced buffers, kept for the next update
    engine.sleep(offload_kv=False)
    assert engine._spare_weights == {}
