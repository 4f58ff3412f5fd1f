"""The scheduler driven directly over a BlockPool (no model: the test samples a token for every
request whose prefill is complete), asserting on block ids and computed tokens."""

from __future__ import annotations

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from inflight.engine.blocks import BlockPool
from inflight.engine.request import Request, RequestStatus, SamplingParams
from inflight.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from inflight.engine.stats import EngineStats

BLOCK = 4


def make_scheduler(
    num_blocks: int = 16, budget: int = 64, max_num_seqs: int = 8, chunked: bool = True, prefix: bool = True
) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs, budget, chunked), BlockPool(num_blocks, BLOCK, prefix))


def add(sched: Scheduler, name: str, tokens: list[int], salt: str | None = None) -> Request:
    request = Request(name, tokens, SamplingParams(max_tokens=100), len(sched.unfinished()), salt)
    sched.add(request)
    return request


def step(sched: Scheduler, version: int = 0) -> SchedulerOutput:
    """One engine step: schedule, 'run the model', sample token 0 where the prompt is consumed."""
    out = sched.schedule(version)
    sched.after_step(out.scheduled)
    for request, _ in out.scheduled:
        if request.num_computed_tokens == request.num_tokens:
            request.append_token(0, 0.0, version)
    return out


def prompt(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


# ---- chunked prefill ---------------------------------------------------------------------------
def test_chunked_prefill_splits_a_prompt_over_the_budget_and_mixes_in_the_next_request():
    sched = make_scheduler(budget=8)
    a, b = add(sched, "a", prompt(1, 10)), add(sched, "b", prompt(50, 3))
    out = step(sched)
    assert out.scheduled == [(a, 8)] and a.block_ids == [0, 1] and a.num_computed_tokens == 8
    assert b.status == RequestStatus.WAITING and b.block_ids == []
    out = step(sched)  # a's last 2 prompt tokens, then b's whole prompt in the rest of the budget
    assert out.scheduled == [(a, 2), (b, 3)]
    assert a.block_ids == [0, 1, 2] and a.num_computed_tokens == 10 and a.num_output_tokens == 1
    assert b.block_ids == [3] and b.num_computed_tokens == 3
    out = step(sched)  # decodes: one token each, no new block (11 and 4 tokens)
    assert out.scheduled == [(a, 1), (b, 1)] and a.block_ids == [0, 1, 2] and b.block_ids == [3]
    out = step(sched)  # b's fifth token needs a second block
    assert b.block_ids == [3, 4] and b.num_computed_tokens == 5


def test_without_chunked_prefill_a_prompt_waits_for_a_budget_that_holds_it_whole():
    sched = make_scheduler(budget=12, chunked=False)
    a, b = add(sched, "a", prompt(1, 10)), add(sched, "b", prompt(50, 3))
    out = step(sched)
    assert out.scheduled == [(a, 10)] and a.block_ids == [0, 1, 2]
    assert b.block_ids == [] and b.num_computed_tokens == 0  # 3 > the 2 tokens left: not admitted
    assert step(sched).scheduled == [(a, 1), (b, 3)]


# ---- preemption ---------------------------------------------------------------------------------
def test_the_newest_running_request_is_preempted_by_recompute():
    sched = make_scheduler(num_blocks=6)
    a, b, c = (add(sched, name, prompt(10 * i + 1, 7)) for i, name in enumerate("abc"))
    step(sched)
    assert (a.block_ids, b.block_ids, c.block_ids) == ([0, 1], [2, 3], [4, 5])
    step(sched)  # 8 tokens each: still two blocks
    out = step(sched)  # the ninth token needs a third block each; the pool is full
    assert out.preemptions == 1 and out.scheduled == [(a, 1), (b, 1)]
    assert a.block_ids == [0, 1, 5] and b.block_ids == [2, 3, 4]  # c's tail block went first
    assert c.status == RequestStatus.WAITING and list(sched.waiting) == [c]
    assert c.block_ids == [] and c.num_computed_tokens == 0 and c.num_tokens == 9  # tokens kept
    sched.finish(a, "length")
    sched.finish(b, "length")
    out = step(sched)  # c comes back and recomputes the 8 tokens it had computed
    assert out.scheduled == [(c, 9)] and out.recomputed_tokens == 8 and c.num_recomputed_tokens == 8


def test_a_newest_request_that_cannot_grow_preempts_itself():
    sched = make_scheduler(num_blocks=4)
    a, b = add(sched, "a", prompt(1, 6)), add(sched, "b", prompt(20, 8))
    step(sched)
    assert (a.block_ids, b.block_ids) == ([0, 1], [2, 3])
    out = step(sched)  # b (9 tokens) needs a third block, and only a is older
    assert out.scheduled == [(a, 1)] and out.preemptions == 1
    assert b.block_ids == [] and list(sched.waiting) == [b] and sched.pool.num_free == 2
    out = step(sched)  # b finds its two blocks cached, but no third one is free: it gives them back
    assert out.scheduled == [(a, 1)] and b.block_ids == [] and b.num_computed_tokens == 0
    assert sched.pool.num_free == 2 and out.prefix_cache_queried_tokens == 0


# ---- prefix cache ----------------------------------------------------------------------------------
def test_prefix_hits_within_a_version_and_misses_across_versions_and_salts():
    sched = make_scheduler()
    tokens = prompt(1, 10)
    a = add(sched, "a", tokens)
    step(sched)  # a's two full prompt blocks are published
    b = add(sched, "b", tokens)
    out = step(sched)
    assert b.block_ids[:2] == a.block_ids[:2] == [0, 1] and b.block_ids[2] not in a.block_ids
    assert out.scheduled == [(a, 1), (b, 2)] and b.num_cached_tokens == 8
    assert (out.prefix_cache_queried_tokens, out.prefix_cache_hit_tokens) == (10, 8)
    assert [sched.pool.blocks[i].ref_count for i in (0, 1, 2)] == [2, 2, 1]
    c = add(sched, "c", tokens)
    out = step(sched, version=1)  # new weights: a's blocks hold KV of version 0
    assert (c, 10) in out.scheduled and set(c.block_ids).isdisjoint(a.block_ids) and c.num_cached_tokens == 0
    d = add(sched, "d", tokens, salt="other-user")
    out = step(sched, version=1)
    assert (d, 10) in out.scheduled and set(d.block_ids).isdisjoint(a.block_ids + c.block_ids)
    e = add(sched, "e", tokens)
    out = step(sched, version=1)  # within version 1, c's blocks are found
    assert e.block_ids[:2] == c.block_ids[:2] and e.num_cached_tokens == 8


def test_a_fully_cached_prompt_still_computes_its_last_block():
    sched = make_scheduler()
    a = add(sched, "a", prompt(1, 8))
    step(sched)
    first = a.block_ids[0]
    sched.finish(a, "length")
    b = add(sched, "b", prompt(1, 8))
    out = step(sched)
    assert b.block_ids[0] == first and out.scheduled == [(b, 4)] and b.num_cached_tokens == 4


def test_freed_blocks_are_reused_last_and_found_until_evicted():
    sched = make_scheduler(num_blocks=5)
    a = add(sched, "a", prompt(1, 9))
    step(sched)
    assert a.block_ids == [0, 1, 2]
    sched.finish(a, "length")  # freed tail first: the free queue is 3, 4, 2, 1, 0
    b = add(sched, "b", prompt(30, 7))
    step(sched)
    assert b.block_ids == [3, 4]
    c = add(sched, "c", prompt(1, 9))
    out = step(sched)
    assert c.block_ids == [0, 1, 2] and c.num_cached_tokens == 8 and (c, 1) in out.scheduled


def test_failed_admission_gives_back_the_prefix_blocks_it_took():
    sched = make_scheduler(num_blocks=4)
    a = add(sched, "a", prompt(1, 9))
    step(sched)
    sched.finish(a, "length")  # blocks 0 and 1 stay cached; the free queue is 3, 2, 1, 0
    b = add(sched, "b", prompt(30, 11))
    step(sched)
    assert b.block_ids == [3, 2, 1]  # block 1's hash is evicted, block 0's survives
    c = add(sched, "c", prompt(1, 9))
    out = step(sched)  # c takes cached block 0, then needs two more: none is free
    assert out.scheduled == [(b, 1)] and list(sched.waiting) == [c]
    assert c.block_ids == [] and c.num_computed_tokens == 0 and c.num_cached_tokens == 0
    assert sched.pool.blocks[0].ref_count == 0 and sched.pool.num_free == 1
    assert sched.pool.lookup(sched.pool.blocks[0].hash, tuple(prompt(1, 4))) == 0  # still cached
    assert out.prefix_cache_queried_tokens == out.prefix_cache_hit_tokens == 0  # nothing booked


# ---- the KV epoch backstop ----------------------------------------------------------------------------
def test_requests_holding_discarded_kv_are_reset_and_counted():
    sched = make_scheduler(num_blocks=8)
    a, b = add(sched, "a", prompt(1, 6)), add(sched, "b", prompt(20, 5))
    step(sched)
    assert (a.block_ids, b.block_ids) == ([0, 1], [2, 3])
    waiting = add(sched, "w", prompt(40, 3))  # holds no KV: not a victim
    sched.pool.invalidate_all()  # what sleep does when it discards the KV pool
    stats = EngineStats()
    stats.kv_invalidated_resets += sched.invalidate_stale_kv()  # what resume() does
    assert stats.kv_invalidated_resets == 2 and list(sched.waiting) == [a, b, waiting]
    assert a.block_ids == b.block_ids == [] and a.num_computed_tokens == b.num_computed_tokens == 0
    assert sched.invalidate_stale_kv() == 0
    out = step(sched)
    assert out.kv_invalidated_resets == 0 and out.scheduled == [(a, 7), (b, 6), (waiting, 3)]
    assert a.block_ids == [4, 5] and b.block_ids == [6, 7]  # the old blocks, freed last, come last
    assert all(sched.pool.blocks[i].epoch == 1 for i in a.block_ids + b.block_ids)
    assert a.num_cached_tokens == 0 and out.recomputed_tokens == 6 + 5


def test_schedule_itself_runs_the_backstop_and_reports_it():
    sched = make_scheduler()
    a = add(sched, "a", prompt(1, 6))
    step(sched)
    sched.pool.invalidate_all()
    out = sched.schedule(0)
    stats = EngineStats()
    stats.book(out)
    assert out.kv_invalidated_resets == stats.kv_invalidated_resets == 1
    assert out.scheduled == [(a, 7)] and sched.pool.blocks[a.block_ids[0]].epoch == 1


# ---- invariants under random workloads ------------------------------------------------------------------
def check_accounting(sched: Scheduler) -> None:
    pool = sched.pool
    holders = Counter(b for r in sched.unfinished() for b in r.block_ids)
    assert pool.num_free + len(holders) == pool.num_blocks  # free + held = total
    assert all(not r.block_ids for r in sched.waiting)  # only running (or frozen) requests hold KV
    for request in sched.unfinished():
        assert len(request.block_ids) == -(-request.num_computed_tokens // BLOCK)
    position: dict[int, set[tuple[int, ...]]] = {}
    for request in sched.unfinished():
        for j, block_id in enumerate(request.block_ids):
            position.setdefault(block_id, set()).add(tuple(request.token_ids[: (j + 1) * BLOCK]))
    for block_id, count in holders.items():
        block = pool.blocks[block_id]
        assert block.ref_count == count
        if count > 1:  # shared only through the prefix cache: the same full prefix in every holder
            assert len(position[block_id]) == 1 and len(block.token_ids) in (0, BLOCK)
            assert block.hash is not None or block.epoch != pool.epoch


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_random_add_step_abort_sequences_keep_block_accounting(data):
    num_blocks = data.draw(st.integers(4, 16), label="num_blocks")
    budget = data.draw(st.integers(1, 20), label="budget")
    sched = make_scheduler(num_blocks, budget, data.draw(st.integers(1, 4)), prefix=data.draw(st.booleans()))
    version, names = 0, iter(range(10**6))
    for _ in range(data.draw(st.integers(1, 50), label="ops")):
        op = data.draw(st.sampled_from(["add", "add", "step", "step", "step", "abort", "update", "discard"]))
        if op == "add":
            tokens = data.draw(st.lists(st.integers(1, 2), min_size=1, max_size=3 * BLOCK))
            if -(-(len(tokens) + 8) // BLOCK) <= num_blocks:
                add(sched, f"r{next(names)}", tokens, data.draw(st.sampled_from([None, "s"])))
        elif op == "step":
            out = step(sched, version)
            assert (
                sum(n for _, n in out.scheduled) <= budget and len(sched.running) <= sched.config.max_num_seqs
            )
            assert len({r.request_id for r, _ in out.scheduled}) == len(out.scheduled)
            assert all(n > 0 and sched.pool.blocks[b].epoch == sched.pool.epoch
                       for r, n in out.scheduled for b in r.block_ids)
            for request, _ in out.scheduled:
                if request.num_output_tokens >= 8:
                    sched.finish(request, "length")
        elif op == "abort" and sched.unfinished():
            sched.finish(data.draw(st.sampled_from(sched.unfinished())), "abort")
        elif op == "update":
            version += 1
        elif op == "discard":
            sched.pool.invalidate_all()
        check_accounting(sched)
    while sched.has_unfinished():
        sched.finish(sched.unfinished()[0], "abort")
    assert sched.pool.num_free == num_blocks
