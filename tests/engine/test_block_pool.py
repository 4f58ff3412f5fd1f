"""Block pool and scheduler invariants under a hypothesis-driven random workload (no model needed:
the test plays the model's part by appending tokens to requests that reached their end)."""

from __future__ import annotations

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from inflight.engine.blocks import BlockPool
from inflight.engine.request import Request, SamplingParams
from inflight.engine.scheduler import Scheduler, SchedulerConfig

BLOCK = 4


def check_invariants(pool: BlockPool, sched: Scheduler) -> None:
    holders = Counter(b for r in sched.unfinished() for b in r.block_ids)
    for block in pool.blocks:
        assert block.ref_count == holders.get(block.block_id, 0), f"block {block.block_id} ref count"
        assert (block.block_id in pool.free_ids) == (block.ref_count == 0)
    for block_hash, block_id in pool.cached.items():
        block = pool.blocks[block_id]
        assert block.hash == block_hash and len(block.token_ids) == BLOCK
    for request in sched.unfinished():
        assert request.num_computed_tokens <= len(request.block_ids) * BLOCK
        for j, block_id in enumerate(request.block_ids):
            block = pool.blocks[block_id]
            if block.hash is not None:  # a published block holds exactly this request's tokens
                assert block.token_ids == tuple(request.token_ids[j * BLOCK : (j + 1) * BLOCK])


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_random_workload_keeps_pool_consistent(data):
    num_blocks = data.draw(st.integers(6, 20), label="num_blocks")
    pool = BlockPool(num_blocks, BLOCK, enable_prefix_caching=data.draw(st.booleans(), label="prefix"))
    sched = Scheduler(
        SchedulerConfig(max_num_seqs=data.draw(st.integers(1, 4)),
                        max_num_batched_tokens=data.draw(st.integers(1, 24)), enable_chunked_prefill=True),
        pool,
    )
    version, arrivals, finished = 0, 0, set()
    for _ in range(data.draw(st.integers(1, 60), label="ops")):
        op = data.draw(st.sampled_from(["add", "add", "step", "step", "step", "abort", "reset", "update"]))
        if op == "add":
            prompt = data.draw(st.lists(st.integers(1, 2), min_size=1, max_size=14))
            max_tokens = data.draw(st.integers(1, 8))
            if -(-(len(prompt) + max_tokens) // BLOCK) > num_blocks:
                continue
            request = Request(f"r{arrivals}", prompt, SamplingParams(max_tokens=max_tokens), arrivals)
            arrivals += 1
            sched.add(request)
        elif op == "step":
            waiting = {id(r) for r in sched.waiting}  # admitted by this schedule: their prefix-cache hits
            scheduled = sched.schedule(version).scheduled
            # are taken now and must be of this version; a request admitted before an update keeps its KV
            # (the `keep` fate: every token carries its version), also while its prefill goes on in chunks
            hits_ok = all(pool.blocks[b].weight_version == version for r, _ in scheduled if id(r) in waiting
                          for b in r.block_ids[: r.num_cached_tokens // BLOCK])
            assert hits_ok, "a new request reused KV of another weight version"
            sched.after_step(scheduled)
            for request, _ in scheduled:
                if request.num_computed_tokens == request.num_tokens:
                    request.append_token(data.draw(st.integers(1, 2)), 0.0, version)
                    if request.num_output_tokens >= request.params.max_tokens:
                        sched.finish(request, "length")
                        finished.add(request.request_id)
        elif op == "abort" and sched.unfinished():
            victim = data.draw(st.sampled_from(sched.unfinished()))
            sched.finish(victim, "abort")
            finished.add(victim.request_id)
        elif op == "reset":
            sched.reset_all()
            pool.reset_prefix_cache()
        elif op == "update":
            version += 1
        check_invariants(pool, sched)
    for _ in range(500):  # drain: every request finishes and every block comes back
        if not sched.has_unfinished():
            break
        scheduled = sched.schedule(version).scheduled
        assert scheduled, "scheduler stalled with unfinished requests"
        sched.after_step(scheduled)
        for request, _ in scheduled:
            if request.num_computed_tokens == request.num_tokens:
                request.append_token(1, 0.0, version)
                if request.num_output_tokens >= request.params.max_tokens:
                    sched.finish(request, "length")
        check_invariants(pool, sched)
    assert not sched.has_unfinished()
    assert pool.num_free == num_blocks


def test_freed_block_stays_reusable_until_evicted():
    pool = BlockPool(3, BLOCK)
    a = pool.allocate(0)
    pool.register(a, 111, (1, 2, 3, 4))
    pool.free(a)
    assert pool.lookup(111, (1, 2, 3, 4)) == a
    assert pool.lookup(111, (9, 9, 9, 9)) is None  # a colliding hash with other tokens is no hit
    b, c = pool.allocate(0), pool.allocate(0)  # least recently freed first: the cached block goes last
    assert a not in (b, c) and pool.lookup(111, (1, 2, 3, 4)) == a
    pool.allocate(0)
    assert pool.lookup(111, (1, 2, 3, 4)) is None


def test_reset_prefix_cache_reports_held_hashes():
    pool = BlockPool(2, BLOCK)
    a = pool.allocate(0)
    pool.register(a, 7, (1, 1, 1, 1))
    assert pool.reset_prefix_cache() is False  # held by a request: not dropped, and it says so
    pool.free(a)
    assert pool.reset_prefix_cache() is True
    assert pool.lookup(7, (1, 1, 1, 1)) is None


def test_a_requests_blocks_match_publish_and_release_by_salt_and_version():
    pool = BlockPool(5, BLOCK)
    tokens = list(range(1, 10))
    a = Request("a", tokens, SamplingParams(), 0, cache_salt="s")
    assert pool.match_prefix(a, 0) == 0 and pool.allocate_slots(a, 9, 0) and a.block_ids == [0, 1, 2]
    a.num_computed_tokens = 9
    pool.publish(a)  # the two full blocks; the third holds one token
    assert len(a.block_hashes) == 2 and [pool.blocks[i].hash is not None for i in a.block_ids] == [
        True,
        True,
        False,
    ]
    same = Request("b", tokens, SamplingParams(), 1, cache_salt="s")
    assert pool.match_prefix(same, 0) == 8 and same.block_ids == [0, 1] and pool.blocks[0].ref_count == 2
    assert pool.match_prefix(Request("c", tokens, SamplingParams(), 2), 0) == 0  # another salt
    assert pool.match_prefix(Request("d", tokens, SamplingParams(), 3, cache_salt="s"), 1) == 0  # new weights
    big = Request("e", list(range(20)), SamplingParams(), 4)
    assert not pool.allocate_slots(big, 20, 0) and big.block_ids == [] and pool.num_free == 2  # takes nothing
    pool.release(same)
    assert same.block_ids == same.block_hashes == [] and same.num_computed_tokens == 0
    assert pool.blocks[0].ref_count == 1 and not pool.holds_stale_kv(a)
    pool.invalidate_all()
    assert pool.holds_stale_kv(a) and not pool.cached
