"""Pause modes (DESIGN.md section 3): abort, keep and wait, and their harmless repetition."""

from __future__ import annotations

import pytest
from conftest_weights import greedy_params, hf_greedy, make_engine, prompt, run_to_completion, tiny_models

from inflight.engine import InvalidRequestError, LLMEngine

MAX_TOKENS = 10


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return tiny_models(tmp_path_factory)


@pytest.fixture
def engine(models) -> LLMEngine:
    return make_engine(models, block_size=4, max_num_batched_tokens=16)


def _in_flight(engine: LLMEngine, lengths=(6, 11), max_tokens=MAX_TOKENS) -> dict[str, list[int]]:
    """Requests that are mid-decode (each has sampled at least one token, none has finished)."""
    prompts = {f"r{n}": prompt(n, n) for n in lengths}
    for request_id, tokens in prompts.items():
        engine.add_request(request_id, tokens, greedy_params(max_tokens))
    for _ in range(20):
        assert engine.step() == []
        if all(engine.requests[r].num_output_tokens >= 2 for r in prompts):
            return prompts
    raise AssertionError("requests did not reach decode")


def _progress(engine: LLMEngine) -> dict[str, int]:
    return {rid: r.num_tokens for rid, r in engine.requests.items()}


def test_abort_returns_partial_outputs_now_and_via_step(engine, models):
    prompts = _in_flight(engine)
    engine.add_request("queued", prompt(7, 70), greedy_params(MAX_TOKENS))  # never scheduled
    progress = {rid: r.num_output_tokens for rid, r in engine.requests.items()}

    aborted = engine.pause("abort")
    assert engine.is_paused
    assert {o.request_id for o in aborted} == set(prompts) | {"queued"}
    for out in aborted:
        assert out.finish_reason == "abort"
        assert len(out.output_token_ids) == progress[out.request_id]
        if out.request_id in prompts:
            assert out.output_token_ids == hf_greedy(
                models.hf_a, prompts[out.request_id], progress[out.request_id]
            )
    assert progress["queued"] == 0
    assert not engine.requests and not engine.has_unfinished_requests()
    assert engine.pool.num_free == engine.pool.num_blocks  # every block released

    # the same outputs come out of the step loop, exactly once
    stepped = engine.step()
    assert sorted(o.request_id for o in stepped) == sorted(o.request_id for o in aborted)
    assert engine.step() == []
    assert engine.stats.aborted_requests == 3

    # a request added while paused runs after resume
    engine.add_request("later", prompt(9, 90), greedy_params(MAX_TOKENS))
    assert engine.step() == [] and engine.requests["later"].num_output_tokens == 0
    engine.resume()
    out = run_to_completion(engine)["later"]
    assert out.finish_reason == "length"
    assert out.output_token_ids == hf_greedy(models.hf_a, prompt(9, 90), MAX_TOKENS)


def test_keep_freezes_in_place_and_queues_new_requests(engine, models):
    prompts = _in_flight(engine)
    blocks = {rid: list(r.block_ids) for rid, r in engine.requests.items()}
    assert engine.pause("keep") == []
    assert engine.is_paused and not engine.can_run
    engine.add_request("new", prompt(5, 50), greedy_params(MAX_TOKENS))
    status = engine.status()
    assert (status.pause, status.pause_mode, status.can_run) == ("paused", "keep", False)
    assert (status.num_running, status.num_waiting, status.num_frozen) == (len(prompts), 1, len(prompts))
    progress, steps = _progress(engine), engine.stats.steps
    for _ in range(3):
        assert engine.step() == []
    assert _progress(engine) == progress
    assert engine.stats.steps == steps
    assert {rid: r.block_ids for rid, r in engine.requests.items() if rid in prompts} == blocks
    assert engine.requests["new"].block_ids == []

    engine.resume()
    outputs = run_to_completion(engine)
    prompts["new"] = prompt(5, 50)
    assert set(outputs) == set(prompts)
    for request_id, tokens in prompts.items():
        assert outputs[request_id].finish_reason == "length"
        # a KEEP pause without an update is invisible in the tokens
        assert outputs[request_id].output_token_ids == hf_greedy(models.hf_a, tokens, MAX_TOKENS)
        assert outputs[request_id].num_recomputed_tokens == 0


def test_wait_drains_in_flight_then_pauses(engine, models):
    prompts = _in_flight(engine, lengths=(6, 11))
    engine.add_request("before", prompt(8, 80), greedy_params(4))  # added before the pause: in flight
    prompts["before"] = prompt(8, 80)
    assert engine.pause("wait") == []
    assert not engine.is_paused  # draining
    engine.add_request("after", prompt(5, 55), greedy_params(MAX_TOKENS))
    status = engine.status()
    assert (status.pause, status.pause_mode, status.draining) == ("draining", "wait", True)
    assert status.can_run and status.num_frozen == 0

    finished = {}
    for _ in range(50):
        for out in engine.step():
            finished[out.request_id] = out
        assert engine.requests["after"].num_output_tokens == 0 and not engine.requests["after"].block_ids
        if engine.is_paused:
            break
    assert set(finished) == set(prompts), "paused before the in-flight requests finished"
    for request_id, tokens in prompts.items():
        assert finished[request_id].finish_reason == "length"
        n = len(finished[request_id].output_token_ids)
        assert finished[request_id].output_token_ids == hf_greedy(models.hf_a, tokens, n)
    for _ in range(3):
        assert engine.step() == []
    assert engine.requests["after"].num_output_tokens == 0
    assert (engine.status().pause, engine.status().pause_mode) == ("paused", "wait")

    engine.resume()
    assert not engine.is_paused
    assert (engine.status().pause, engine.status().pause_mode) == ("running", None)
    out = run_to_completion(engine)["after"]
    assert out.output_token_ids == hf_greedy(models.hf_a, prompt(5, 55), MAX_TOKENS)


def test_wait_with_nothing_in_flight_pauses_at_once(engine):
    assert engine.pause("wait") == []
    assert engine.is_paused
    engine.add_request("queued", prompt(5, 5), greedy_params(3))
    assert engine.step() == [] and engine.requests["queued"].num_output_tokens == 0
    engine.resume()
    assert run_to_completion(engine)["queued"].finish_reason == "length"


def test_wait_pauses_when_the_last_in_flight_request_is_aborted(engine):
    _in_flight(engine, lengths=(6,))
    engine.pause("wait")
    engine.add_request("after", prompt(5, 55), greedy_params(3))
    engine.abort(["r6"])
    engine.step()
    assert engine.is_paused, "nothing is in flight any more: the wait pause must have landed"
    assert engine.requests["after"].num_output_tokens == 0
    engine.resume()
    assert run_to_completion(engine)["after"].finish_reason == "length"


def test_second_wait_pause_does_not_admit_later_requests(engine):
    _in_flight(engine, lengths=(6,))
    engine.pause("wait")
    engine.add_request("after", prompt(5, 55), greedy_params(3))
    engine.pause("wait")  # pausing twice is harmless: "after" still waits for resume()
    for _ in range(30):
        engine.step()
        assert engine.requests["after"].num_output_tokens == 0
        if engine.is_paused:
            break
    assert engine.is_paused and "r6" not in engine.requests
    engine.resume()
    assert run_to_completion(engine)["after"].finish_reason == "length"


def test_pausing_twice_and_resuming_unpaused_are_harmless(engine, models):
    engine.resume()  # not paused: nothing happens
    assert engine.can_run and not engine.is_paused
    prompts = _in_flight(engine)
    assert engine.pause("keep") == []
    progress = _progress(engine)
    assert engine.pause("keep") == []
    assert engine.pause("abort") == []  # already paused: frozen requests are not aborted
    assert _progress(engine) == progress and set(engine.requests) == set(prompts)
    assert engine.stats.pauses == 1
    engine.resume()
    engine.resume()
    outputs = run_to_completion(engine)
    for request_id, tokens in prompts.items():
        assert outputs[request_id].output_token_ids == hf_greedy(models.hf_a, tokens, MAX_TOKENS)


def test_unknown_pause_mode_is_rejected(engine):
    with pytest.raises(InvalidRequestError, match="sleepy"):
        engine.pause("sleepy")
    assert not engine.is_paused and engine.stats.pauses == 0
