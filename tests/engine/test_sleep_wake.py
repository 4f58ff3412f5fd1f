"""sleep / wake_up (DESIGN.md section 3, memory pools): memory is really released, the rotary table
survives, an offloaded KV pool comes back bit-identical at the same block ids, a discarded one never
comes back, and the scheduler's block tables are untouched throughout."""

from __future__ import annotations

import gc
import os
import re
import weakref

import pytest
import torch
from conftest_weights import (
    greedy_params,
    hf_greedy,
    make_engine,
    prompt,
    run_to_completion,
    split,
    tiny_models,
    update_weights,
)

from inflight.engine import EngineStateError, InvalidRequestError, LLMEngine, WeightUpdateError

MAX_TOKENS = 10
PROMPTS = {"r6": prompt(6, 6), "r13": prompt(13, 13)}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return tiny_models(tmp_path_factory)


@pytest.fixture
def engine(models) -> LLMEngine:
    return make_engine(models, block_size=4, max_num_batched_tokens=16)


def _frozen(engine: LLMEngine) -> dict[str, list[int]]:
    """Requests mid-decode, KEEP-paused; returns their block tables."""
    for request_id, tokens in PROMPTS.items():
        engine.add_request(request_id, tokens, greedy_params(MAX_TOKENS))
    for _ in range(20):
        assert engine.step() == []
        if all(engine.requests[r].num_output_tokens >= 2 for r in PROMPTS):
            break
    assert engine.pause("keep") == []
    return {rid: list(r.block_ids) for rid, r in engine.requests.items()}


def _assert_greedy_a(models, outputs) -> None:
    assert set(outputs) == set(PROMPTS)
    for request_id, tokens in PROMPTS.items():
        assert outputs[request_id].finish_reason == "length"
        assert outputs[request_id].output_token_ids == hf_greedy(models.hf_a, tokens, MAX_TOKENS)


def _storage_bytes(engine: LLMEngine) -> int:
    return sum(p.untyped_storage().nbytes() for p in engine.model.parameters())


def test_sleep_releases_weights_and_kv_but_keeps_rotary(engine, models):
    blocks = _frozen(engine)
    cos_sin = engine.model.cos_sin.clone()
    assert engine.weights.nbytes > 0 and engine.kv_cache.nbytes > 0
    kv_ref = weakref.ref(engine.kv_cache.tensor)
    engine.sleep(offload_kv=False)
    gc.collect()
    assert engine.kv_cache.tensor is None and engine.kv_cache.nbytes == 0
    assert kv_ref() is None, "the discarded KV tensor is still referenced somewhere"
    assert engine.weights.nbytes == 0 and _storage_bytes(engine) == 0
    assert engine.model.cos_sin is not None and torch.equal(engine.model.cos_sin, cos_sin)
    assert {rid: r.block_ids for rid, r in engine.requests.items()} == blocks  # scheduler untouched
    assert not engine.can_run and engine.step() == []

    engine.wake_up()
    assert engine.weights.nbytes > 0 and engine.kv_cache.nbytes > 0
    assert torch.count_nonzero(engine.kv_cache.tensor) == 0  # discarded: nothing comes back
    assert torch.equal(engine.model.cos_sin, cos_sin)
    with pytest.raises(EngineStateError):
        engine.resume()  # weights were dropped: a full update must land first
    update_weights(engine, models.weights_a)
    engine.resume()
    assert engine.stats.kv_invalidated_resets == len(PROMPTS)
    outputs = run_to_completion(engine)
    _assert_greedy_a(models, outputs)  # rotary survived: the re-prefilled requests are exact
    assert all(o.num_recomputed_tokens > 0 for o in outputs.values())


def _rss_bytes() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs /proc to read the RSS")
def test_sleep_lowers_resident_memory(models):
    # 64 MiB: above glibc's largest mmap threshold (32 MiB), so freeing it returns it to the OS
    engine = make_engine(models, block_size=16, num_kv_blocks=16384)
    size = engine.kv_cache.nbytes
    assert size >= 64 * 2**20
    gc.collect()
    before = _rss_bytes()
    engine.sleep(offload_kv=False)
    gc.collect()
    assert before - _rss_bytes() > size // 2
    engine.wake_up()
    assert engine.kv_cache.nbytes == size


def test_offloaded_kv_returns_bit_identical_at_same_block_ids(engine, models):
    blocks = _frozen(engine)
    kv = engine.kv_cache.tensor.clone()
    cos_sin = engine.model.cos_sin.clone()
    epoch = engine.pool.epoch
    engine.sleep(offload_kv=True)
    assert engine.kv_cache.tensor is None and engine.weights.nbytes == 0
    with pytest.raises(EngineStateError):
        engine.resume()
    engine.wake_up(["kv_cache"])
    assert torch.equal(engine.kv_cache.tensor, kv)
    assert engine.pool.epoch == epoch
    assert {rid: r.block_ids for rid, r in engine.requests.items()} == blocks
    with pytest.raises(EngineStateError):
        engine.begin_weight_update()  # the weights pool still sleeps
    engine.wake_up(["weights"])
    assert torch.equal(engine.model.cos_sin, cos_sin)
    update_weights(engine, models.weights_a)  # the same weights, a new version
    engine.resume()
    outputs = run_to_completion(engine)
    _assert_greedy_a(models, outputs)  # offload + same weights is invisible in the tokens
    assert engine.stats.kv_invalidated_resets == 0
    assert all(o.num_recomputed_tokens == 0 for o in outputs.values())


def test_wake_and_sleep_repeated_are_harmless(engine, models):
    _frozen(engine)
    kv = engine.kv_cache.tensor.clone()
    engine.wake_up()  # awake already: nothing changes
    assert torch.equal(engine.kv_cache.tensor, kv)
    engine.sleep(offload_kv=True)
    engine.sleep(offload_kv=True)
    engine.wake_up(["kv_cache"])
    engine.wake_up(["kv_cache"])
    assert torch.equal(engine.kv_cache.tensor, kv)
    with pytest.raises(InvalidRequestError, match="gpu"):
        engine.wake_up(["gpu"])
    engine.wake_up(["weights"])
    update_weights(engine, models.weights_a)
    engine.resume()
    _assert_greedy_a(models, run_to_completion(engine))


def test_discard_after_offload_really_discards(engine, models):
    """sleep(offload_kv=False) on an offloaded pool drops the host copy: it must not come back."""
    _frozen(engine)
    engine.sleep(offload_kv=True)
    engine.sleep(offload_kv=False)
    engine.wake_up()
    assert torch.count_nonzero(engine.kv_cache.tensor) == 0
    update_weights(engine, models.weights_a)
    engine.resume()
    assert engine.stats.kv_invalidated_resets == len(PROMPTS)
    _assert_greedy_a(models, run_to_completion(engine))


def test_sleep_during_an_update_forgets_what_was_loaded(engine, models):
    """Parameters loaded before a sleep are gone; finishing without re-loading them must fail."""
    _frozen(engine)
    first, second = split(models.weights_b, 2)
    engine.begin_weight_update()
    engine.load_weights(first)
    engine.sleep(offload_kv=True)
    with pytest.raises(EngineStateError, match="asleep"):
        engine.load_weights(second)  # nowhere to copy them
    engine.wake_up()
    engine.load_weights(second)
    with pytest.raises(WeightUpdateError, match=re.escape(repr(sorted(n for n, _ in first)[0]))):
        engine.finish_weight_update()
    with pytest.raises(EngineStateError):
        engine.resume()
    update_weights(engine, models.weights_a)
    engine.resume()
    _assert_greedy_a(models, run_to_completion(engine))
