"""The converse lending: the engines take the trainer's threads while it waits for groups, read at
each engine step (in this process and in an engine's own process), and give them back at their
next step once it stops waiting; the greedy tokens do not change, and the logprobs move by no more
than torch's own forward moves between those thread counts."""

from __future__ import annotations

import asyncio
import pickle

import pytest
import torch

from inflight.client.process import EngineProcess
from inflight.engine import AsyncEngine, EngineConfig, LLMEngine, SamplingParams
from inflight.engine.step_threads import EngineThreads, SharedThreads
from inflight.orchestration.thread_lending import ThreadLending, ThreadSplit

PROMPTS = [[3, 17, 29, 41, 5], [7, 11, 13], [19, 23, 31, 37, 43, 47, 53]]


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory):
    # wide enough that torch's matmuls and our kernels split their work over two threads
    return tiny_model_factory("qwen2", hidden_size=256, intermediate_size=1024, num_hidden_layers=2)


def _lending() -> ThreadLending:
    """The fully-async trainer's split of one trainer thread and one engine's thread."""
    lending = ThreadSplit(trainer=1, engine=1, lendable=1, follow=True).lending()
    assert lending.engine_lendable == 1 and not lending.lent
    return lending


def _engine(model_dir, threads) -> AsyncEngine:
    return AsyncEngine(LLMEngine(EngineConfig(model=str(model_dir), num_kv_blocks=64, max_num_seqs=8)),
                       threads=threads)


def test_only_the_fully_async_split_lends_the_trainer_threads_to_its_engines():
    assert ThreadSplit(1, 2, 1).lending().shared is None  # synchronous: the engines have them for good
    assert ThreadSplit(1, 1).lending().shared is None  # lending off
    assert ThreadSplit(1, 1, 2, follow=True, engines=2).lending().engine_lendable == 0  # 1 thread, 2 engines
    lending = ThreadSplit(4, 1, 2, follow=True, engines=2).lending()
    assert lending.engine_lendable == 2 and lending.engine_threads(1, 1) == EngineThreads(
        lending.shared, 1, 1
    )
    lending.close()
    assert ThreadLending(1).engine_threads(0, 3) == 3


def test_the_engine_computes_with_the_lent_threads_while_the_trainer_waits(model_dir):
    lending = _lending()
    engine = _engine(model_dir, lending.engine_threads(0, 1))
    greedy = SamplingParams(max_tokens=8, temperature=0.0)

    async def main():
        with lending.waiting():  # the trainer waits for groups: every step takes its thread
            await engine.generate(PROMPTS[0], greedy)
            assert engine.health()["threads"] == 2
        own, lent = lending.shared.steps()
        assert own == 0 and lent >= 8
        await engine.generate(PROMPTS[1], greedy)  # a training step runs: the engine's own thread
        assert lending.shared.steps() == (own + 8, lent) and engine.health()["threads"] == 1
        assert lending.metrics() == {"threads/engine_steps": own + 8 + lent,
                                     "threads/engine_lent_fraction": lent / (own + 8 + lent)}
        assert lending.metrics()["threads/engine_steps"] == 0  # counted since the last call
        await engine.close()

    try:
        asyncio.run(main())
    finally:
        lending.close()


def test_a_step_that_starts_mid_generation_gets_its_thread_back_at_the_next_engine_step(model_dir):
    lending, k, n = _lending(), 4, 24
    engine = _engine(model_dir, lending.engine_threads(0, 1))

    async def main():
        seen = 0
        waiting = lending.waiting()
        waiting.__enter__()
        stream = engine.generate_stream(PROMPTS[2], SamplingParams(max_tokens=n, temperature=0.0))
        async for _ in stream:
            seen += 1
            if seen == k:  # after k steps a training step starts: the wait ends
                waiting.__exit__(None, None, None)
        await engine.close()

    try:
        asyncio.run(main())
        own, lent = lending.shared.steps()
        # the step already running when the wait ended may finish with the lent thread; none after it
        assert own + lent == n and k <= lent <= k + 1
    finally:
        lending.close()


def _greedy(model_dir, lend: bool) -> list:
    lending = _lending()
    engine = _engine(model_dir, lending.engine_threads(0, 1))
    params = SamplingParams(max_tokens=16, temperature=0.0, seed=7)

    async def main():
        if not lend:
            return await asyncio.gather(*(engine.generate(p, params) for p in PROMPTS))
        with lending.waiting():
            return await asyncio.gather(*(engine.generate(p, params) for p in PROMPTS))

    try:
        outs = asyncio.run(main())
        assert lending.shared.steps()[1 if lend else 0] > 0 and lending.shared.steps()[0 if lend else 1] == 0
        return outs
    finally:
        lending.close()


def _torch_spread(model_dir, hf_model_factory, outs) -> float:
    """How far torch's own forward (transformers) moves the logprobs of these tokens between one
    and two threads: the reference's variation at the thread counts the lending switches between."""
    model = hf_model_factory(model_dir)
    spread = 0.0
    for out in outs:
        ids = torch.tensor([out.prompt_token_ids + out.output_token_ids])
        logprobs = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            with torch.no_grad():
                logits = model(ids).logits[0, len(out.prompt_token_ids) - 1:-1].float()
            logprobs.append(torch.log_softmax(logits, -1).gather(1, ids[0, len(out.prompt_token_ids):, None]))
        torch.set_num_threads(1)
        spread = max(spread, (logprobs[0] - logprobs[1]).abs().max().item())
    return spread


def test_lending_leaves_the_greedy_tokens_and_logprobs_as_they_were(model_dir, hf_model_factory):
    own, lent = _greedy(model_dir, lend=False), _greedy(model_dir, lend=True)
    assert [o.output_token_ids for o in lent] == [o.output_token_ids for o in own]
    ours = max(
        abs(a - b)
        for o, x in zip(own, lent, strict=True)
        for a, b in zip(o.logprobs, x.logprobs, strict=True)
    )
    magnitude = max(abs(a) for o in own for a in o.logprobs)
    # within what torch itself varies by between those thread counts, or float32 rounding of the values
    assert ours <= max(
        _torch_spread(model_dir, hf_model_factory, own), 8 * torch.finfo(torch.float32).eps * magnitude
    )


def test_an_engine_in_its_own_process_reads_the_lent_threads_at_each_step(model_dir):
    lending = _lending()
    config = EngineConfig(model=str(model_dir), num_kv_blocks=64)
    greedy = SamplingParams(max_tokens=6, temperature=0.0)

    async def main(proc: EngineProcess):
        with lending.waiting():
            await proc.client.generate(PROMPTS[0], greedy)
        after_wait = lending.shared.steps()
        await proc.client.generate(PROMPTS[1], greedy)
        return after_wait, lending.shared.steps()

    try:
        with EngineProcess(config, lending.engine_threads(0, 1)) as proc:
            (own, lent), after = asyncio.run(main(proc))
        assert own == 0 and lent >= 6 and after == (6, lent)
    finally:
        lending.close()


def test_shared_threads_travel_by_their_file_and_the_lender_removes_it():
    shared = SharedThreads(2)
    copy = pickle.loads(pickle.dumps(shared))
    shared.lend(3)
    copy.record(1, lent=True)
    copy.record(0, lent=False)
    assert copy.lent == 3 and shared.steps(1) == (0, 1) and shared.steps() == (1, 1)
    with pytest.raises(ValueError, match="fewer than 0"):
        shared.lend(-1)
    copy.close()
    shared.close()
    with pytest.raises(FileNotFoundError):
        SharedThreads(2, shared.path)
