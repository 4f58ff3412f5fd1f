"""One sync through LocalPolicy reaching several real engines behind a FanOutClient, with
requests in flight on each: every engine lands on the new version and its frozen requests end as
the plan's KV fate promises (transformers as the oracle). An engine that rejects the update makes
the sync fail loudly, naming it, and every engine goes back to the old weights and resumes."""

from __future__ import annotations

import asyncio

import pytest
from conftest_weights import SMALL, hf_greedy, make_engine
from sync_scenarios import PROMPTS, check_fate, row_config, start_in_flight

from inflight.client import FanOutError, LocalClient
from inflight.client.fanout import FanOutClient
from inflight.engine import AsyncEngine, SamplingParams, WeightUpdateError
from inflight.testing import make_tiny_model
from inflight.train import LocalPolicy
from inflight.weight_sync import InProcessTransport, ShmReceiver, ShmTransport

# row -> (fate, transport)
CASES = {
    "async-keep": ("keep", "inprocess"),
    "async-clear": ("recompute", "inprocess"),
    "async-clear-offload": ("recompute", "shm"),
}




def _transport(kind: str, engines):
    if kind == "inprocess":
        return InProcessTransport(max_chunk_bytes=8192), []
    transport = ShmTransport(num_receivers=len(engines), max_chunk_bytes=8192, timeout=60)
    receivers = [
        ShmReceiver("127.0.0.1", transport.port, rank=i + 1, num_receivers=len(engines), timeout=60)
        for i in range(len(engines))
    ]
    for receiver, engine in zip(receivers, engines, strict=True):
        receiver.serve_in_thread(engine)
    return transport, receivers


async def start_frozen(clients, engines) -> list[dict[str, asyncio.Task]]:
    """Requests mid-decode on every engine, each engine frozen (KEEP) as soon as its requests decode,
    so that waiting for a slower engine cannot let another one's requests finish before the sync;
    the sync's own KEEP pause is then a no-op and its resume releases them."""

    async def start(client, engine):
        tasks = await start_in_flight(client, engine)
        await client.pause("keep")
        return tasks

    return list(await asyncio.gather(*(start(c, e) for c, e in zip(clients, engines, strict=True))))


@pytest.mark.parametrize("row", list(CASES))
def test_sync_in_flight_reaches_every_engine_with_the_plans_fate(models, worker_b, row):
    fate, kind = CASES[row]

    async def run():
        engines = [make_engine(models, enable_prefix_caching=True, seed=i) for i in range(2)]
        clients = [LocalClient(AsyncEngine(e)) for e in engines]
        transport, _ = _transport(kind, engines)
        tasks = await start_frozen(clients, engines)
        policy = LocalPolicy(row_config(row, True), worker_b, FanOutClient(clients), transport)
        try:
            report = await policy.sync_weights()
            outputs = [{rid: await t for rid, t in per.items()} for per in tasks]
            version = await policy.client.weight_version()
        finally:
            transport.close()
            await asyncio.gather(*(c.engine.close() for c in clients))
        return engines, policy, report, outputs, version

    engines, policy, report, outputs, version = asyncio.run(run())
    assert policy.plan.kv_fate == fate and report.ok and report.steps == policy.plan.steps()
    assert version == 1 and [e.weight_version for e in engines] == [1, 1]
    for engine, out in zip(engines, outputs, strict=True):
        check_fate(out, fate, models.hf_a, models.hf_b)
        assert engine.stats.weight_updates == 1 and not engine.is_paused


def test_an_engine_rejecting_the_update_fails_the_sync_and_every_engine_keeps_the_old_weights(
    models, worker_b, tmp_path
):
    odd = make_tiny_model(tmp_path / "odd", arch="qwen2", seed=0, **{**SMALL, "intermediate_size": 96})

    async def run():
        engines = [make_engine(models, enable_prefix_caching=True) for _ in range(2)]
        engines.append(make_engine(models, model=str(odd)))  # same names, other shapes
        clients = [LocalClient(AsyncEngine(e)) for e in engines]
        tasks = await start_frozen(clients[:2], engines[:2])
        cfg = row_config("async-keep", True)
        policy = LocalPolicy(cfg, worker_b, FanOutClient(clients), InProcessTransport(max_chunk_bytes=8192))
        with pytest.raises(FanOutError) as err:
            await policy.sync_weights()
        paused = [e.is_paused for e in engines]
        outputs = [{rid: await t for rid, t in per.items()} for per in tasks]
        after = await clients[2].generate([5, 6, 7], SamplingParams(max_tokens=3, temperature=0.0))
        versions = await policy.client.weight_versions()
        await asyncio.gather(*(c.engine.close() for c in clients))
        return policy, err.value, paused, outputs, after, versions

    policy, err, paused, outputs, after, versions = asyncio.run(run())
    assert set(err.errors) == {"engine-2"} and isinstance(err.errors["engine-2"], WeightUpdateError)
    assert "load_weights" in str(err) and "engine-2" in str(err)
    assert paused == [False] * 3 and versions == {"engine-0": 0, "engine-1": 0, "engine-2": 0}
    assert policy.failed_syncs == 1 and policy.weight_version == 0 and len(after.output_token_ids) == 3
    for out in outputs:  # the engines that took the update went back to model A, nothing was lost
        for rid, o in out.items():
            assert set(o.token_weight_versions) == {0} and o.finish_reason == "length"
            assert o.output_token_ids == hf_greedy(models.hf_a, PROMPTS[rid], len(o.output_token_ids))
