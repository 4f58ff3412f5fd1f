"""Every row of the plan table (docs/design.md section 4) executed end to end through LocalPolicy:
a real engine (LLMEngine behind AsyncEngine and LocalClient) with requests in flight, a policy worker
holding model B, the engine starting on model A. The frozen requests end exactly as the row's KV
fate promises (transformers as the oracle), the prefix cache is reset exactly when the plan says,
and the executed steps are the plan's.
"""

from __future__ import annotations

import asyncio
from dataclasses import asdict

import pytest
from conftest_weights import make_engine
from sync_scenarios import (
    PROMPTS,
    ROWS,
    check_colocated,
    check_fate,
    check_row,
    colocated_sync,
    row_config,
    stale_cached_blocks,
    start_in_flight,
)

from inflight.client import LocalClient
from inflight.engine import AsyncEngine
from inflight.train import LocalPolicy
from inflight.weight_sync import InProcessTransport, ShmReceiver, ShmTransport


async def in_flight_sync(models, worker, cfg, prefix: bool, transport=None, receiver=None):
    engine = make_engine(models, enable_prefix_caching=prefix)
    client = LocalClient(AsyncEngine(engine))
    if receiver is not None:
        receiver(engine)
    tasks = await start_in_flight(client, engine)
    policy = LocalPolicy(cfg, worker, client, transport or InProcessTransport(max_chunk_bytes=8192))
    report = await policy.sync_weights()
    stale = stale_cached_blocks(engine, 1)
    outputs = {rid: await task for rid, task in tasks.items()}
    await client.engine.close()
    return engine, policy, report, stale, outputs


@pytest.mark.parametrize("prefix", [False, True], ids=["no-prefix-cache", "prefix-cache"])
@pytest.mark.parametrize("row", [r for r in ROWS if r != "colocated"])
def test_plan_row_with_requests_in_flight(models, worker_b, row, prefix):
    cfg = row_config(row, prefix)
    engine, policy, report, stale, outputs = asyncio.run(in_flight_sync(models, worker_b, cfg, prefix))
    fate = check_row(policy.plan, asdict(report), asdict(engine.stats), stale, prefix, models.weights_b)
    assert report.version == policy.weight_version == engine.weight_version
    assert {"pause_s", "send_s", "total_s"} <= set(policy.timings)
    assert policy.timings["pause_s"] <= policy.timings["total_s"]
    check_fate(outputs, fate, models.hf_a, models.hf_b)


@pytest.mark.parametrize("prefix", [False, True], ids=["no-prefix-cache", "prefix-cache"])
def test_colocated_row(models, worker_b, prefix):
    """Colocated: the engine slept after generation; the sync wakes it, loads B, resets the cache."""

    async def run():
        client = LocalClient(AsyncEngine(make_engine(models, enable_prefix_caching=prefix)))
        policy = LocalPolicy(row_config("colocated", prefix), worker_b, client, InProcessTransport())
        report, after = await colocated_sync(client, policy)
        await client.engine.close()
        return policy.plan, report, after

    plan, report, after = asyncio.run(run())
    check_colocated(asdict(report), plan, prefix, after, models.hf_b)


def test_reset_through_a_cross_process_transport(models, worker_b):
    """A cross-process transport (shm, its receiver in a thread of the engine's process) carries
    only the weights: the executor issues the reset itself, and the frozen requests are reset and
    recomputed. The executor has the transport stage the update before it pauses the engine: every
    chunk was packed while the engine still ran, and the pause only posted their messages."""
    cfg = row_config("async-clear", True)
    transport = ShmTransport(port=0, max_chunk_bytes=8192, timeout=60)
    paused_when_staged, stage = [], transport.stage

    def receiver(engine):
        ShmReceiver("127.0.0.1", transport.port, timeout=60).serve_in_thread(engine)

        async def stage_and_look(named_tensors):
            paused_when_staged.append(engine.is_paused)
            staged = await stage(named_tensors)
            paused_when_staged.append(engine.is_paused)
            return staged

        transport.stage = stage_and_look

    try:
        engine, policy, report, stale, outputs = asyncio.run(
            in_flight_sync(models, worker_b, cfg, True, transport, receiver)
        )
    finally:
        transport.close()
    assert policy.plan.resets and report.steps == policy.plan.steps() and "reset" in report.steps
    assert report.prefix_cache_empty is True and stale == []
    assert paused_when_staged == [False, False] and report.timings["stage_s"] > 0
    assert transport._packs == report.chunks > 2  # every chunk packed once, in the stage
    assert engine.stats.resets == len(PROMPTS)
    check_fate(outputs, "recompute", models.hf_a, models.hf_b)
