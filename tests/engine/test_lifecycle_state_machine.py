"""Random interleavings of the whole engine lifecycle, checked against invariants after every rule.

Requests, steps, aborts, every pause mode, resume, sleep (offload or discard), wake_up, complete,
partial, failed and abandoned weight updates (model A, model B, or the same weights under a higher
version; an abandoned one rolls back when the engine holds a copy of the old weights)
and prefix-cache resets, on a tiny KV cache so that preemption happens. Besides the block-pool
bookkeeping, the machine watches every model step as it happens: nothing runs on discarded KV,
paused or incomplete weights, and every sampled token must equal transformers' greedy token when
each position's KV is computed by the weights that computed it in the engine (its "provenance":
model A, model B, kept across an update, recomputed after a reset, or served by the prefix cache).

Hunting: INFLIGHT_STATE_MACHINE_RANDOM=1 INFLIGHT_STATE_MACHINE_EXAMPLES=500 explores new
interleavings (CI stays deterministic); INFLIGHT_NO_SHRINK=1 skips shrinking a failure.
"""

from __future__ import annotations

import os
from collections import defaultdict

import pytest
import torch
from conftest_weights import greedy_params, hf_greedy, hf_next_token, make_engine, prompt, split, tiny_models
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from inflight.engine import EngineStateError, LLMEngine, WeightUpdateError

MAX_TOKENS = 6
_BASE = prompt(12, 100)
PROMPTS = [_BASE[:4], _BASE[:9], prompt(5, 101), prompt(3, 102)]  # 0 and 1 share two blocks
SYNC_MODES = st.sampled_from(["keep", "wait", "keep", "abort"])
SYNC_FATES = st.sampled_from(["discard", "offload", "recompute", "keep"])
_NEXT_TOKEN: dict[tuple, int] = {}  # (tokens, provenance) -> transformers' greedy token, shared by examples
PHASES = [Phase.explicit, Phase.reuse, Phase.generate] + (
    [] if os.environ.get("INFLIGHT_NO_SHRINK") else [Phase.shrink]
)
EXAMPLES = int(os.environ.get("INFLIGHT_STATE_MACHINE_EXAMPLES", "50"))


class Lifecycle(RuleBasedStateMachine):
    models = None  # set by the test before the machine runs
    engine_overrides: dict = {}

    def __init__(self) -> None:
        super().__init__()
        models = type(self).models
        self.weights = {"A": models.weights_a, "B": models.weights_b}
        self.hf = {"A": models.hf_a, "B": models.hf_b}
        self.engine: LLMEngine = make_engine(models, **type(self).engine_overrides)
        self.size = self.engine.config.block_size
        # the model of the engine's lifecycle state
        self.tag = "A"  # weights in the model when they are complete
        self.version_tag = {0: "A"}
        self.valid = True
        self.weights_awake = True
        self.kv_awake = True
        self.partial: tuple[str, set[str]] | None = None  # update in progress: (target, names loaded)
        self.rollback = False  # abort_weight_update() would bring the weights of `tag` back
        self.draining = False
        self.pause_mode: str | None = None  # the mode of the pause in effect (a drain's is "wait")
        # requests
        self.counter = 0
        self.prompt_of: dict[str, int] = {}
        self.max_tokens: dict[str, int] = {}
        self.held_back: set[str] = set()  # added during a pause: no progress until resume()
        self.step_tags: dict[str, set[str]] = defaultdict(set)  # weights every step of a request ran on
        # per request and position: the weights that computed the KV the engine holds there
        self.provenance: dict[str, list[str]] = defaultdict(list)
        self.outputs: dict[str, object] = {}
        self.aborted: dict[str, object] = {}  # returned by abort()/pause("abort"), not yet by step()
        self._oracle: dict[tuple[str, int], list[int]] = {}
        self._watch_model_steps()

    # ---- instrumentation ----------------------------------------------------------------------
    def _watch_model_steps(self) -> None:
        """Check every model step as it happens, and every sampled token against transformers fed
        with the same KV provenance (which weights computed the KV of each position)."""
        engine, execute, reset = self.engine, self.engine.runner.execute, self.engine.scheduler.reset

        def checked_execute(scheduled):
            assert self.valid and self.partial is None and self.weights_awake and self.kv_awake
            assert engine.kv_cache.awake and engine.weights.awake and not engine.is_paused
            assert engine.status().can_run
            expected = {}
            for request, n in scheduled:
                request_id, computed = request.request_id, request.num_computed_tokens
                assert request_id not in self.held_back
                assert computed + n <= len(request.block_ids) * self.size
                stale = [b for b in request.block_ids if engine.pool.blocks[b].epoch != engine.pool.epoch]
                assert not stale, f"{request_id} would attend to discarded KV in blocks {stale}"
                self.step_tags[request_id].add(self.tag)
                provenance = self.provenance[request_id]
                if computed > len(provenance):  # a prefix-cache hit at admission, under this version
                    assert engine.pool.enable_prefix_caching and not provenance
                    provenance.extend([self.tag] * computed)
                assert len(provenance) == computed
                provenance.extend([self.tag] * n)
                if computed + n == request.num_tokens:
                    expected[request_id] = (list(request.token_ids), list(provenance))
            sampled = execute(scheduled)
            for request, token, *_ in sampled:
                tokens, provenance = expected.pop(request.request_id)
                assert token == self.next_token(tokens, provenance), (
                    f"{request.request_id}: token {token} is not what transformers samples with KV "
                    f"provenance {provenance}"
                )
            assert not expected
            return sampled

        def tracked_reset(request):
            self.provenance[request.request_id] = []
            reset(request)

        engine.runner.execute = checked_execute
        engine.scheduler.reset = tracked_reset

    def next_token(self, tokens: list[int], provenance: list[str]) -> int:
        key = (tuple(tokens), tuple(provenance))
        if key not in _NEXT_TOKEN:
            _NEXT_TOKEN[key] = hf_next_token(self.hf, tokens, provenance)
        return _NEXT_TOKEN[key]

    def oracle(self, tag: str, index: int) -> list[int]:
        key = (tag, index)
        if key not in self._oracle:
            self._oracle[key] = hf_greedy(self.hf[tag], PROMPTS[index], MAX_TOKENS)
        return self._oracle[key]

    # ---- rules --------------------------------------------------------------------------------
    @initialize(
        indices=st.lists(st.integers(0, len(PROMPTS) - 1), min_size=2, max_size=4),
        steps=st.integers(1, 6),
        sync=st.tuples(SYNC_MODES, SYNC_FATES, st.sampled_from([True, False])),
    )
    def some_requests_in_flight(self, indices: list[int], steps: int, sync) -> None:
        """Start with requests in flight and a whole weight sync across them (the simplest
        draws, which Hypothesis favours, are the interesting ones: KEEP pause, KV discarded, A -> B)."""
        for index in indices:
            self.add_request(index, MAX_TOKENS)
        self.step(steps)
        self.weight_sync(*sync)

    @rule(index=st.integers(0, len(PROMPTS) - 1), max_tokens=st.integers(1, MAX_TOKENS))
    def add_request(self, index: int, max_tokens: int) -> None:
        request_id = f"q{self.counter}"
        self.counter += 1
        self.engine.add_request(request_id, PROMPTS[index], greedy_params(max_tokens))
        self.prompt_of[request_id] = index
        self.max_tokens[request_id] = max_tokens
        if self.engine.is_paused or self.draining:
            self.held_back.add(request_id)

    @rule(times=st.integers(0, 6))
    def step(self, times: int) -> None:
        for _ in range(times):
            could_run = self.engine.can_run
            status, steps = self.engine.status(), self.engine.stats.steps
            progress = {rid: r.num_tokens for rid, r in self.engine.requests.items()}
            for out in self.engine.step():
                self._record(out)
            # status().can_run says whether step() runs the model on the unfinished requests
            assert (self.engine.stats.steps > steps) == (status.can_run and status.has_unfinished)
            if not could_run:
                assert {rid: r.num_tokens for rid, r in self.engine.requests.items()} == progress
            elif self.engine.has_unfinished_requests() and not self.engine.is_paused:
                # the backstop has run: no running request holds KV of an older epoch
                for request in self.engine.scheduler.running:
                    assert all(
                        self.engine.pool.blocks[b].epoch == self.engine.pool.epoch for b in request.block_ids
                    )

    @precondition(lambda self: self.engine.can_run and self.engine.has_unfinished_requests())
    @rule()
    def step_until_one_finishes(self) -> None:
        for _ in range(30):
            outs = self.engine.step()
            for out in outs:
                self._record(out)
            if outs or not self.engine.can_run:
                return

    @precondition(lambda self: self.valid and self.partial is None and self.weights_awake and self.kv_awake)
    @rule(mode=SYNC_MODES, fate=SYNC_FATES, switch=st.booleans())
    def weight_sync(self, mode: str, fate: str, switch: bool) -> None:
        """A whole in-flight weight sync as a trainer drives it."""
        self.pause(mode)
        for _ in range(400):
            if self.engine.is_paused:
                break
            for out in self.engine.step():
                self._record(out)
        assert self.engine.is_paused
        self.draining = False
        if fate in ("offload", "discard"):
            self.sleep(offload=fate == "offload")
            self.wake_up(["weights"])
        if fate == "recompute":
            self.reset_prefix_cache(reset_running=True)
        self.full_update(switch=switch, bump=1, chunks=2)
        if fate in ("offload", "discard"):
            self.wake_up(["kv_cache"])
        holding = sum(1 for r in self.engine.requests.values() if r.block_ids)
        before = self.engine.stats.kv_invalidated_resets
        self.resume()
        assert self.engine.stats.kv_invalidated_resets - before == (holding if fate == "discard" else 0)

    @precondition(lambda self: self.engine.requests)
    @rule(data=st.data())
    def abort(self, data) -> None:
        ids = sorted(self.engine.requests)
        chosen = data.draw(st.lists(st.sampled_from(ids), min_size=1, max_size=2, unique=True))
        progress = {rid: self.engine.requests[rid].num_output_tokens for rid in chosen}
        outs = self.engine.abort(chosen + ["no-such-request"])
        assert sorted(o.request_id for o in outs) == sorted(chosen)
        for out in outs:
            assert out.finish_reason == "abort" and len(out.output_token_ids) == progress[out.request_id]
            self.aborted[out.request_id] = out
        self._after_drain_change()

    @rule(mode=st.sampled_from(["abort", "keep", "wait"]))
    def pause(self, mode: str) -> None:
        was_paused = self.engine.is_paused
        unfinished = set(self.engine.requests)
        outs = self.engine.pause(mode)
        assert self.engine.is_paused or (mode == "wait" and not was_paused)
        if was_paused or mode != "abort":
            assert outs == []
        else:
            assert {o.request_id for o in outs} == unfinished and not self.engine.requests
            for out in outs:
                assert out.finish_reason == "abort"
                self.aborted[out.request_id] = out
        if not was_paused:
            self.draining = mode == "wait" and not self.engine.is_paused
            self.pause_mode = mode

    @rule()
    def resume(self) -> None:
        ok = self.weights_awake and self.kv_awake and self.valid and self.partial is None
        if ok:
            self.engine.resume()
            assert not self.engine.is_paused
            self.held_back.clear()
            self.draining = False
            self.pause_mode = None
        else:
            with pytest.raises(EngineStateError):
                self.engine.resume()

    @rule(offload=st.booleans())
    def sleep(self, offload: bool) -> None:
        blocks = {rid: list(r.block_ids) for rid, r in self.engine.requests.items()}
        self.engine.sleep(offload_kv=offload)
        assert self.engine.kv_cache.tensor is None and self.engine.weights.nbytes == 0
        assert {rid: r.block_ids for rid, r in self.engine.requests.items()} == blocks
        self.weights_awake = self.kv_awake = self.valid = self.rollback = False
        if self.partial is not None:
            self.partial = (self.partial[0], set())

    @rule(tags=st.sampled_from([["weights"], ["kv_cache"], ["weights", "kv_cache"]]))
    def wake_up(self, tags: list[str]) -> None:
        self.engine.wake_up(tags)
        self.weights_awake |= "weights" in tags
        self.kv_awake |= "kv_cache" in tags
        assert self.engine.weights.awake == self.weights_awake and self.engine.kv_cache.awake == self.kv_awake

    def _target(self, switch: bool) -> str:
        return {"A": "B", "B": "A"}[self.tag] if switch else self.tag

    @rule(switch=st.booleans(), bump=st.integers(1, 3), chunks=st.integers(1, 3))
    def full_update(self, switch: bool, bump: int, chunks: int) -> None:
        target = self._target(switch)
        if not self.weights_awake:
            with pytest.raises(EngineStateError):
                self.engine.begin_weight_update()
            return
        version = self.engine.weight_version + bump
        self._begin()
        for part in split(self.weights[target], chunks):
            self.engine.load_weights(part)
        assert self.engine.finish_weight_update(version) == version
        self._landed(target, version)

    def _begin(self) -> None:
        """begin_weight_update(): on complete weights it keeps a rollback copy (the default);
        restarting an open or failed update keeps the copy it had."""
        self.engine.begin_weight_update()
        if self.partial is None and self.valid:
            self.rollback = True

    def _landed(self, target: str, version: int) -> None:
        self.tag, self.valid, self.partial, self.rollback = target, True, None, False
        self.version_tag[version] = target
        assert self.engine.weight_version == version

    @precondition(lambda self: self.weights_awake)
    @rule(switch=st.booleans())
    def begin_partial_update(self, switch: bool) -> None:
        target = self._target(switch)
        first = split(self.weights[target], 2)[0]
        self._begin()
        self.engine.load_weights(first)
        self.partial = (target, {name for name, _ in first})

    @precondition(lambda self: self.partial is not None and self.weights_awake)
    @rule()
    def finish_partial_update(self) -> None:
        target, loaded = self.partial
        rest = [(n, t) for n, t in self.weights[target].items() if n not in loaded]
        self.engine.load_weights(rest)
        if len(loaded) + len(rest) == len(self.weights[target]):
            version = self.engine.finish_weight_update()
            self._landed(target, version)
        else:  # a sleep dropped what was loaded before it
            with pytest.raises(WeightUpdateError, match="missing"):
                self.engine.finish_weight_update()
            self.partial, self.valid = None, False

    @precondition(lambda self: self.weights_awake)
    @rule(kind=st.sampled_from(["missing", "shape", "unknown"]))
    def failed_update(self, kind: str) -> None:
        items = sorted(self.weights[self._target(True)].items())
        version = self.engine.weight_version
        self._begin()
        self.engine.load_weights(items[:5])
        if kind == "shape":
            with pytest.raises(WeightUpdateError, match=items[5][0]):
                self.engine.load_weights([(items[5][0], torch.zeros(3))])
        elif kind == "unknown":
            with pytest.raises(WeightUpdateError, match="no_such"):
                self.engine.load_weights([("model.no_such.weight", torch.zeros(3))])
        with pytest.raises(WeightUpdateError, match="missing"):
            self.engine.finish_weight_update()
        assert self.engine.weight_version == version and not self.engine.can_run
        self.partial, self.valid = None, False

    @rule()
    def abort_update(self) -> None:
        """Abandon the update in progress or the one that failed: back to the weights of `tag`
        exactly when a rollback copy exists (after a sleep there is none)."""
        version = self.engine.weight_version
        assert self.engine.abort_weight_update() is self.rollback
        assert self.engine.weight_version == version
        self.valid |= self.rollback
        self.partial, self.rollback = None, False

    @rule(reset_running=st.booleans())
    def reset_prefix_cache(self, reset_running: bool) -> None:
        empty = self.engine.reset_prefix_cache(reset_running_requests=reset_running)
        assert empty == (not self.engine.pool.cached)
        if reset_running:
            assert all(not r.block_ids and r.num_computed_tokens == 0 for r in self.engine.requests.values())
        if empty is False:  # only blocks still held by requests keep their hashes
            assert all(self.engine.pool.blocks[b].ref_count > 0 for b in self.engine.pool.cached.values())

    # ---- outputs ------------------------------------------------------------------------------
    def _record(self, out) -> None:
        request_id = out.request_id
        assert request_id not in self.outputs, f"{request_id} was output twice"
        assert request_id in self.prompt_of
        self.outputs[request_id] = out
        if request_id in self.aborted:
            assert out.output_token_ids == self.aborted.pop(request_id).output_token_ids
        n = len(out.output_token_ids)
        assert out.finish_reason in ("length", "abort")
        if out.finish_reason == "length":
            assert n == self.max_tokens[request_id]
        assert n <= self.max_tokens[request_id]
        versions = out.token_weight_versions
        assert len(versions) == n and versions == sorted(versions)
        assert all(v in self.version_tag for v in versions)
        tags = self.step_tags.get(request_id, set())
        if len(tags) == 1:  # every step ran on one set of weights: exactly transformers' greedy tokens
            (tag,) = tags
            assert {self.version_tag[v] for v in versions} <= {tag}
            assert out.output_token_ids == self.oracle(tag, self.prompt_of[request_id])[:n]
        self._after_drain_change()

    def _after_drain_change(self) -> None:
        if self.draining and not any(r not in self.held_back for r in self.engine.requests):
            assert self.engine.is_paused, "a wait pause with nothing in flight must have landed"
            self.draining = False

    # ---- invariants ---------------------------------------------------------------------------
    @invariant()
    def block_pool_is_consistent(self) -> None:
        pool, size = self.engine.pool, self.size
        holders: dict[int, int] = defaultdict(int)
        for request in self.engine.requests.values():
            assert len(set(request.block_ids)) == len(request.block_ids)
            for block_id in request.block_ids:
                holders[block_id] += 1
        for block in pool.blocks:
            assert block.ref_count == holders.get(block.block_id, 0), f"block {block.block_id} ref count"
            assert (block.block_id in pool.free_ids) == (block.ref_count == 0)
        for block_hash, block_id in pool.cached.items():
            block = pool.blocks[block_id]
            assert block.hash == block_hash and len(block.token_ids) == size
        for request in self.engine.requests.values():
            assert len(request.block_hashes) <= len(request.block_ids)
            for j, block_id in enumerate(request.block_ids):
                block = pool.blocks[block_id]
                if block.hash is not None:
                    assert block.token_ids == tuple(request.token_ids[j * size : (j + 1) * size])
            assert request.num_computed_tokens <= len(request.block_ids) * size
            assert request.num_computed_tokens < request.num_tokens

    @invariant()
    def lifecycle_flags_agree(self) -> None:
        engine = self.engine
        expected = self.valid and self.partial is None and self.weights_awake and self.kv_awake
        assert engine.can_run == (expected and not engine.is_paused)
        for request_id in self.held_back & set(engine.requests):
            assert engine.requests[request_id].num_output_tokens == 0

    @invariant()
    def status_agrees(self) -> None:
        """One status() snapshot says what the model of the lifecycle says."""
        engine, status = self.engine, self.engine.status()
        update = "open" if self.partial is not None else "none" if self.valid else "invalid"
        pause = "paused" if engine.is_paused else "draining" if self.draining else "running"
        assert (status.pause, status.pause_mode, status.update) == (pause, self.pause_mode, update)
        assert status.paused == engine.is_paused and status.draining == self.draining == engine.is_draining
        assert (status.weights_awake, status.kv_cache_awake) == (self.weights_awake, self.kv_awake)
        assert status.can_run == engine.can_run and status.weight_version == engine.weight_version
        assert status.num_running + status.num_waiting == len(engine.requests)
        assert status.has_unfinished == engine.has_unfinished_requests()
        assert status.num_frozen == (0 if status.can_run else status.num_running)
        assert status.can_roll_back == self.rollback
        assert status.to_dict()["update"] == update

    def teardown(self) -> None:
        """Finally wake, complete an update if needed, resume: every request must finish."""
        engine = self.engine
        engine.wake_up()
        self.weights_awake = self.kv_awake = True
        if not self.valid or self.partial is not None:
            self.full_update(switch=False, bump=1, chunks=2)
        engine.resume()
        self.held_back.clear()
        self.draining = False
        self.pause_mode = None
        for _ in range(400):
            for out in engine.step():
                self._record(out)
            if not engine.has_unfinished_requests():
                break
        assert not engine.has_unfinished_requests() and not self.aborted
        assert set(self.outputs) == set(self.prompt_of)
        assert engine.pool.num_free == engine.pool.num_blocks


@pytest.mark.parametrize("chunked", [True, False], ids=["chunked", "whole-prefill"])
@pytest.mark.parametrize("prefix", [True, False], ids=["prefix-cache", "no-prefix-cache"])
def test_lifecycle_state_machine(tmp_path_factory, prefix, chunked):
    Lifecycle.models = tiny_models(tmp_path_factory)
    Lifecycle.engine_overrides = dict(
        block_size=2,
        num_kv_blocks=9,
        max_num_seqs=4,
        max_model_len=32,
        max_num_batched_tokens=8 if chunked else 32,
        enable_prefix_caching=prefix,
        enable_chunked_prefill=chunked,
    )
    run_state_machine_as_test(
        Lifecycle,
        settings=settings(
            max_examples=EXAMPLES,
            stateful_step_count=40,
            deadline=None,
            database=None,
            derandomize=os.environ.get("INFLIGHT_STATE_MACHINE_RANDOM") is None,
            phases=PHASES,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        ),
    )
