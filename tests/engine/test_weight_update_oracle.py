"""In-flight weight updates against Hugging Face transformers as the oracle (DESIGN.md section 3).

Requests are stopped mid-decode, the weights change from model A to model B, and every token the
engine samples afterwards is compared with transformers:

- fate `keep` / `offload`: model A's KV stays (or comes back bit-identical from host memory) and model
  B continues on top of it. The KV of the last token sampled before the update is not in the cache
  yet: model B computes it in the first step after resume, and so does the oracle.
- fate `recompute` (explicit reset) and the SkyRL cell (KV discarded by sleep, no reset call, the
  engine's backstop resets): model B re-reads the whole sequence so far.
"""

from __future__ import annotations

import re

import pytest
import torch
from conftest_weights import (
    greedy_params,
    hf_continue,
    hf_greedy,
    make_engine,
    prompt,
    run_to_completion,
    split,
    tiny_models,
    update_weights,
)

from inflight.engine import EngineStateError, LLMEngine, WeightUpdateError

MAX_TOKENS = 24
FATES = ("keep", "offload", "recompute", "skyrl")
PROMPTS = {"r5": prompt(5, 1), "r17": prompt(17, 2), "r33": prompt(33, 3)}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return tiny_models(tmp_path_factory)


def _engine(models, prefix: bool, chunked: bool) -> LLMEngine:
    # block size 4 (chunked) or 8 (whole prefills): prompts of 5, 17 and 33 tokens span blocks
    return make_engine(
        models,
        block_size=4 if chunked else 8,
        enable_prefix_caching=prefix,
        enable_chunked_prefill=chunked,
        max_num_batched_tokens=8 if chunked else 128,
        max_model_len=128,
    )


def _start_mid_decode(engine: LLMEngine) -> None:
    """Add the requests at different times, then step until each has sampled at least two tokens."""
    params = greedy_params(MAX_TOKENS)
    for request_id, tokens in PROMPTS.items():
        engine.add_request(request_id, tokens, params)
        assert engine.step() == []
        assert engine.step() == []
    for _ in range(50):
        if all(len(engine.get_request_output(r).output_token_ids) >= 2 for r in PROMPTS):
            return
        assert engine.step() == [], "a request finished before the update"
    raise AssertionError("requests did not reach decode")


def _snapshot(engine: LLMEngine) -> dict[str, tuple[list[int], int]]:
    """Per request: the tokens so far (prompt + output) and how many of them have KV in the cache."""
    snap = {}
    for request_id in PROMPTS:
        request = engine.requests[request_id]
        # mid-decode: everything but the last sampled token has KV
        assert request.num_computed_tokens == request.num_tokens - 1
        assert 2 <= request.num_output_tokens < MAX_TOKENS
        snap[request_id] = (list(request.token_ids), request.num_computed_tokens)
    return snap


def _apply_fate(engine: LLMEngine, fate: str, weights_b: dict[str, torch.Tensor]) -> None:
    """Pause(keep), move to model B's weights the way the fate prescribes, resume."""
    holding = sum(1 for r in engine.requests.values() if r.block_ids)
    assert holding == len(PROMPTS)
    assert engine.pause("keep") == []
    if fate == "keep":
        update_weights(engine, weights_b, chunks=2)
    elif fate == "offload":
        kv = engine.kv_cache.tensor.clone()
        blocks = {rid: list(r.block_ids) for rid, r in engine.requests.items()}
        engine.sleep(offload_kv=True)
        assert engine.kv_cache.tensor is None and engine.weights.nbytes == 0
        engine.wake_up(["weights"])
        update_weights(engine, weights_b, chunks=3)
        engine.wake_up(["kv_cache"])
        assert torch.equal(engine.kv_cache.tensor, kv)
        assert {rid: r.block_ids for rid, r in engine.requests.items()} == blocks
    elif fate == "recompute":
        assert engine.reset_prefix_cache(reset_running_requests=True) is True
        assert engine.stats.resets == holding
        assert all(not r.block_ids and r.num_computed_tokens == 0 for r in engine.requests.values())
        update_weights(engine, weights_b, chunks=2)
    else:  # the SkyRL cell: KV discarded by sleep, nobody asks for a reset
        engine.sleep(offload_kv=False)
        engine.wake_up(["weights"])
        update_weights(engine, weights_b, chunks=2)
        engine.wake_up(["kv_cache"])
        assert engine.stats.resets == 0
    assert engine.weight_version == 1
    engine.resume()
    assert engine.stats.kv_invalidated_resets == (holding if fate == "skyrl" else 0)
    if fate == "skyrl":
        assert all(not r.block_ids and r.num_computed_tokens == 0 for r in engine.requests.values())


@pytest.mark.parametrize("chunked", [False, True], ids=["whole-prefill", "chunked"])
@pytest.mark.parametrize("prefix", [False, True], ids=["no-prefix-cache", "prefix-cache"])
@pytest.mark.parametrize("fate", FATES)
def test_frozen_requests_continue_as_transformers_predicts(models, fate, prefix, chunked):
    engine = _engine(models, prefix, chunked)
    _start_mid_decode(engine)
    snap = _snapshot(engine)
    _apply_fate(engine, fate, models.weights_b)
    outputs = run_to_completion(engine)
    assert set(outputs) == set(PROMPTS)

    fates_differ = False
    for request_id, tokens in PROMPTS.items():
        out = outputs[request_id]
        seq, num_cached = snap[request_id]
        before = seq[len(tokens) :]
        rest = MAX_TOKENS - len(before)
        assert out.finish_reason == "length"
        assert len(out.output_token_ids) == MAX_TOKENS
        assert out.token_weight_versions == [0] * len(before) + [1] * rest
        # before the update: model A's greedy tokens
        assert out.output_token_ids[: len(before)] == before == hf_greedy(models.hf_a, tokens, len(before))
        kept = hf_continue(models.hf_a, models.hf_b, seq, num_cached, rest)
        recomputed = hf_greedy(models.hf_b, seq, rest)
        fates_differ |= kept != recomputed
        after = out.output_token_ids[len(before) :]
        if fate in ("keep", "offload"):
            assert after == kept, f"{request_id}: not model B over model A's KV"
            assert out.num_recomputed_tokens == 0
        else:
            assert after == recomputed, f"{request_id}: not model B re-reading the sequence"
            # every token that had KV before the update is computed again, once
            assert out.num_recomputed_tokens == num_cached
        assert after != hf_greedy(models.hf_a, seq, rest), "the update did not take effect"
    assert fates_differ, "the oracle cannot tell keep from recompute here; pick other prompts"


@pytest.mark.parametrize("chunked", [False, True], ids=["whole-prefill", "chunked"])
def test_prefix_cache_never_serves_old_weights(models, chunked):
    engine = _engine(models, prefix=True, chunked=chunked)
    size = engine.config.block_size
    tokens = prompt(29, 7)
    full_blocks = (len(tokens) - 1) // size * size
    first = engine.generate([tokens], greedy_params(8))[0]
    again = engine.generate([tokens], greedy_params(8))[0]
    assert first.num_cached_tokens == 0
    assert again.num_cached_tokens == full_blocks > 0  # within one version, reuse is normal
    assert first.output_token_ids == again.output_token_ids == hf_greedy(models.hf_a, tokens, 8)

    engine.pause("keep")
    update_weights(engine, models.weights_b)
    engine.resume()
    assert engine.pool.cached, "the old blocks are still hashed: only their version keeps them out"
    after = engine.generate([tokens], greedy_params(8))[0]
    assert after.num_cached_tokens == 0
    assert after.output_token_ids == hf_greedy(models.hf_b, tokens, 8)
    assert after.token_weight_versions == [1] * 8
    again_b = engine.generate([tokens], greedy_params(8))[0]
    assert again_b.num_cached_tokens == full_blocks
    assert again_b.output_token_ids == after.output_token_ids


def test_blocks_mixing_old_and_new_kv_are_never_reused(models):
    """A request kept across the update fills new blocks with model B attending to model A's KV;
    a new request over the same tokens must not be served those blocks."""
    engine = _engine(models, prefix=True, chunked=True)
    _start_mid_decode(engine)
    snap = _snapshot(engine)
    _apply_fate(engine, "keep", models.weights_b)
    outputs = run_to_completion(engine)
    seq = PROMPTS["r33"] + outputs["r33"].output_token_ids
    assert len(seq) > len(snap["r33"][0]) + engine.config.block_size
    new = engine.generate([seq[:-1]], greedy_params(4))[0]
    assert new.num_cached_tokens == 0
    assert new.output_token_ids == hf_greedy(models.hf_b, seq[:-1], 4)


# ---- failed updates ---------------------------------------------------------------------------
FAILURES = ("missing", "shape", "unknown", "stale-version")


def _fail_update(engine: LLMEngine, weights: dict[str, torch.Tensor], failure: str) -> None:
    """Start an update that writes some garbage, then fails the way `failure` says."""
    items = sorted(weights.items())
    garbage = [(name, torch.randn_like(t)) for name, t in items[:6]]
    engine.begin_weight_update()
    engine.load_weights(garbage)
    if failure == "missing":
        name = items[-1][0]
        engine.load_weights(items[6:-1])
        with pytest.raises(WeightUpdateError, match=re.escape(repr(name))):
            engine.finish_weight_update()
    elif failure == "shape":
        name, tensor = items[7]
        bad = torch.zeros(tensor.shape[0] + 1, *tensor.shape[1:])
        with pytest.raises(WeightUpdateError) as err:
            engine.load_weights([items[8], (name, bad)])
        assert repr(name) in str(err.value) and str(tuple(tensor.shape)) in str(err.value)
    elif failure == "unknown":
        name = "model.layers.7.mlp.up_proj.weight"
        with pytest.raises(WeightUpdateError, match=re.escape(repr(name))):
            engine.load_weights([(name, items[0][1])])
    else:
        engine.load_weights(items[6:])
        with pytest.raises(WeightUpdateError, match="must be greater"):
            engine.finish_weight_update(engine.weight_version)


def _assert_frozen(engine: LLMEngine) -> None:
    progress = {rid: r.num_tokens for rid, r in engine.requests.items()}
    steps = engine.stats.steps
    for _ in range(3):
        assert engine.step() == []
    assert {rid: r.num_tokens for rid, r in engine.requests.items()} == progress
    assert engine.stats.steps == steps
    assert not engine.can_run


@pytest.mark.parametrize("failure", FAILURES)
def test_failed_update_blocks_generation_until_a_complete_one_lands(models, failure):
    engine = _engine(models, prefix=True, chunked=True)
    _start_mid_decode(engine)
    snap = _snapshot(engine)
    engine.pause("keep")
    _fail_update(engine, models.weights_b, failure)
    assert engine.weight_version == 0
    assert engine.stats.failed_weight_updates == 1
    with pytest.raises(EngineStateError):
        engine.resume()
    assert engine.is_paused
    _assert_frozen(engine)

    assert update_weights(engine, models.weights_b, chunks=2) == 1
    engine.resume()
    outputs = run_to_completion(engine)
    for request_id, tokens in PROMPTS.items():
        seq, num_cached = snap[request_id]
        before = seq[len(tokens) :]
        rest = MAX_TOKENS - len(before)
        out = outputs[request_id]
        assert out.output_token_ids[: len(before)] == before
        assert out.output_token_ids[len(before) :] == hf_continue(
            models.hf_a, models.hf_b, seq, num_cached, rest
        )
        assert out.token_weight_versions == [0] * len(before) + [1] * rest


def test_update_without_pause_still_blocks_steps(models):
    """Generation never runs on a half-updated model, even when the caller forgot to pause."""
    engine = _engine(models, prefix=False, chunked=True)
    _start_mid_decode(engine)
    snap = _snapshot(engine)
    chunks = split(models.weights_b, 3)
    engine.begin_weight_update()
    _assert_frozen(engine)
    engine.load_weights(chunks[0])
    _assert_frozen(engine)
    engine.load_weights(chunks[1])
    engine.load_weights(chunks[2])
    assert engine.finish_weight_update() == 1
    assert engine.can_run and not engine.is_paused
    outputs = run_to_completion(engine)
    for request_id, tokens in PROMPTS.items():
        seq, num_cached = snap[request_id]
        rest = MAX_TOKENS - (len(seq) - len(tokens))
        kept = hf_continue(models.hf_a, models.hf_b, seq, num_cached, rest)
        assert outputs[request_id].output_token_ids[len(seq) - len(tokens) :] == kept


def test_same_weights_new_version_matches_uninterrupted_run(models):
    """An update to the same weights with a higher version changes versions, not tokens."""
    engine = _engine(models, prefix=True, chunked=True)
    _start_mid_decode(engine)
    snap = _snapshot(engine)
    engine.pause("keep")
    assert update_weights(engine, models.weights_a, version=5) == 5
    engine.resume()
    outputs = run_to_completion(engine)
    for request_id, tokens in PROMPTS.items():
        n_before = len(snap[request_id][0]) - len(tokens)
        out = outputs[request_id]
        assert out.output_token_ids == hf_greedy(models.hf_a, tokens, MAX_TOKENS)
        assert out.token_weight_versions == [0] * n_before + [5] * (MAX_TOKENS - n_before)
