"""The staleness manager, the output buffer and the data loader: the capacity law under random
completion orders (hypothesis), no deadlock when groups are filtered, epoch-end accounting and the
consumed-prompt record through a checkpoint."""

from __future__ import annotations

import asyncio
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inflight.train.staleness import AsyncDataLoader, OutputBuffer, StalenessManager


@settings(max_examples=200, deadline=None)
@given(
    staleness=st.integers(0, 3),
    mini=st.integers(1, 4),
    workers=st.integers(1, 12),
    seed=st.integers(0, 2**31),
    filter_p=st.sampled_from([0.0, 0.3, 0.9]),
)
def test_capacity_law_under_random_completion_orders(staleness, mini, workers, seed, filter_p):
    """Drive the manager like the trainer does, choosing at random which running group finishes
    next, whether it is filtered, and when the trainer steps. At every moment accepted + running
    <= (staleness + global_step) * mini and running <= workers; every trained group is at most
    `staleness` steps old; and the loop always has a move (never deadlocks)."""
    workers = max(workers, mini)
    rng = random.Random(seed)
    m = StalenessManager(staleness, mini, workers)
    buffer: OutputBuffer[int] = OutputBuffer()
    running: list[tuple[int, int]] = []  # (ticket, global_step at start) of each running group
    steps_done = 0
    for _ in range(400):
        moves = []
        if m.capacity() > 0:
            moves.append("start")
        if running:
            moves.append("finish")
        if buffer.ready >= mini:
            moves.append("train")
        assert moves, f"deadlock: {m.state()}, buffer {len(buffer)}"
        move = rng.choice(moves)
        if move == "start":
            assert m.try_start()
            running.append((buffer.ticket(), m.global_step))
        elif move == "finish":
            seq, started = running.pop(rng.randrange(len(running)))
            if rng.random() < filter_p:
                m.reject()
                buffer.skip(seq)
            else:
                m.accept()
                buffer.put(started, seq)
        else:
            batch = asyncio.run(buffer.get(mini))
            for started in batch:  # trained at step m.global_step, by weights of version global_step - 1
                assert m.global_step - started <= staleness
            m.step_done()
            steps_done += 1
        assert m.accepted + m.running <= m.limit
        assert m.running <= workers and m.running == len(running)
    assert m.try_start() or running or buffer.ready >= mini
    if filter_p < 0.9:
        assert steps_done > 0


def test_rejected_groups_release_capacity():
    m = StalenessManager(0, 2, None)
    assert m.try_start() and m.try_start() and not m.try_start()
    m.reject()
    assert m.capacity() == 1 and m.rejected == 1
    m.accept()
    assert m.try_start() and not m.try_start()
    m.step_done()
    assert m.limit == 4 and m.capacity() == 2


def test_resume_state_of_the_window():
    m = StalenessManager(2, 4, None, global_step=6, accepted=20)
    assert m.limit == 32 and m.capacity() == 12


def test_async_workers_and_trainer_never_deadlock_with_filtering():
    """Real asyncio: K workers block in `start()`, finish in random order, most groups are
    filtered for a while; the trainer still gets every batch and the data runs out cleanly."""

    async def run() -> tuple[list[list[int]], int]:
        rng = random.Random(0)
        items = list(range(120))
        loader = AsyncDataLoader(items, epochs=1, seed=3)
        m = StalenessManager(1, 4, 6)
        buffer: OutputBuffer[int] = OutputBuffer()

        def maybe_close() -> None:
            if loader.exhausted and m.running == 0:
                buffer.close()

        async def worker() -> None:
            while True:
                await m.start()
                seq = buffer.ticket()
                ref = loader.next()
                if ref is None:
                    m.cancel()
                    buffer.skip(seq)
                    maybe_close()
                    return
                await asyncio.sleep(rng.random() * 0.002)
                if ref.index < 60 and rng.random() < 0.8:  # a long stretch of filtered groups
                    m.reject()
                    buffer.skip(seq)
                    loader.mark_consumed(ref)
                else:
                    m.accept()
                    buffer.put(ref, seq)
                maybe_close()

        tasks = [asyncio.create_task(worker()) for _ in range(6)]
        batches = []
        while True:
            refs = await buffer.get(4)
            if not refs:
                break
            for ref in refs:
                loader.mark_consumed(ref)
            batches.append([r.index for r in refs])
            m.step_done()
        await asyncio.gather(*tasks)
        return batches, loader.num_consumed(0)

    batches, consumed = asyncio.run(asyncio.wait_for(run(), timeout=30))
    assert consumed == 120
    trained = [i for b in batches for i in b]
    assert len(trained) == len(set(trained)) and all(len(b) == 4 for b in batches[:-1])


def test_output_buffer_hands_out_in_start_order():
    async def run() -> list[list[str]]:
        buf: OutputBuffer[str] = OutputBuffer()
        a, b, c, d = (buf.ticket() for _ in range(4))
        buf.put("c", c)
        buf.put("b", b)
        assert buf.ready == 0  # "a" is still running: nobody overtakes it
        buf.skip(a)
        assert buf.ready == 2
        first = await buf.get(2)
        buf.put("d", d)
        return [first, await buf.get(1)]

    assert asyncio.run(run()) == [["b", "c"], ["d"]]


def test_output_buffer_partial_only_after_close():
    async def run() -> tuple[list[int], list[int]]:
        buf: OutputBuffer[int] = OutputBuffer()
        buf.put(1)
        waiter = asyncio.create_task(buf.get(2))
        await asyncio.sleep(0.01)
        assert not waiter.done()
        buf.put(2)
        first = await waiter
        buf.put(3)
        later = asyncio.create_task(buf.get(2))
        await asyncio.sleep(0.01)
        buf.close()
        return first, await later

    first, rest = asyncio.run(run())
    assert first == [1, 2] and rest == [3]


def test_loader_epoch_end_accounting():
    loader = AsyncDataLoader(list("abcdefg"), epochs=2, seed=1)
    refs = []
    while (ref := loader.next()) is not None:
        refs.append(ref)
    assert loader.exhausted and len(refs) == 14
    for epoch in (0, 1):
        assert sorted(r.index for r in refs if r.epoch == epoch) == list(range(7))
    assert [r.index for r in refs[:7]] != list(range(7))  # shuffled
    random.Random(0).shuffle(refs)
    for ref in refs:
        loader.mark_consumed(ref)
    assert loader.num_consumed(0) == 7 and loader.num_consumed(1) == 7
    with pytest.raises(RuntimeError, match="consumed twice"):
        loader.mark_consumed(refs[0])


@settings(max_examples=100, deadline=None)
@given(seed=st.integers(0, 2**31), n=st.integers(1, 30), epochs=st.integers(1, 3), taken=st.integers(0, 90))
def test_loader_state_resumes_exactly_the_unconsumed(seed, n, epochs, taken):
    """Hand out some prompts, consume a random subset (the rest are 'in flight'), checkpoint,
    resume: the resumed loader hands out exactly the unconsumed ones, each once."""
    rng = random.Random(seed)
    loader = AsyncDataLoader(list(range(n)), epochs=epochs, seed=seed)
    handed = [r for r in (loader.next() for _ in range(min(taken, n * epochs))) if r is not None]
    consumed = [r for r in handed if rng.random() < 0.6]
    for ref in consumed:
        loader.mark_consumed(ref)
    state = loader.state()
    resumed = AsyncDataLoader(list(range(n)), epochs=epochs, seed=seed)
    resumed.load_state(state)
    rest = []
    while (ref := resumed.next()) is not None:
        rest.append((ref.epoch, ref.index))
    done = {(r.epoch, r.index) for r in consumed}
    assert len(rest) == len(set(rest))
    assert set(rest) == {(e, i) for e in range(epochs) for i in range(n)} - done


def test_loader_rejects_a_foreign_state():
    state = AsyncDataLoader(list(range(5)), seed=1).state()
    with pytest.raises(ValueError, match="another dataset"):
        AsyncDataLoader(list(range(6)), seed=1).load_state(state)
