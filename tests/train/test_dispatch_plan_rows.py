"""Every row of the plan table (docs/design.md section 4) executed end to end through WorkerDispatch:
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
from inflight.train import WorkerDispatch
from inflight.weight_sync import InProcessTransport


async def in_flight_sync(models, worker, cfg, prefix: bool, transport=None, receiver=None):
    engine = make_engine(models, enable_prefix_caching=prefix)
    client = LocalClient(AsyncEngine(engine))
    if receiver is not None:
        receiver(engine)
    tasks = await start_in_flight(client, engine)
    dispatch = WorkerDispatch([worker], client, transport or InProcessTransport(max_chunk_bytes=8192), cfg)
    report = await dispatch.save_weights_for_sampler()
    stale = stale_cached_blocks(engine, 1)
    outputs = {rid: await task for rid, task in tasks.items()}
    await client.engine.close()
    return engine, dispatch, report, stale, outputs


@pytest.mark.parametrize("prefix", [False, True], ids=["no-prefix-cache", "prefix-cache"])
@pytest.mark.parametrize("row", [r for r in ROWS if r != "colocated"])
def test_plan_row_with_requests_in_flight(models, worker_b, row, prefix):
    cfg = row_config(row, prefix)
    engine, dispatch, report, stale, outputs = asyncio.run(in_flight_sync(models, worker_b, cfg, prefix))
    fate = check_row(dispatch.plan, asdict(report), asdict(engine.stats), stale, prefix, models.weights_b)
    assert report.version == dispatch.weight_version == engine.weight_version
    assert {"pause_s", "send_s", "total_s"} <= set(dispatch.timings)
    assert dispatch.timings["pause_s"] <= dispatch.timings["total_s"]
    check_fate(outputs, fate, models.hf_a, models.hf_b)


@pytest.mark.parametrize("prefix", [False, True], ids=["no-prefix-cache", "prefix-cache"])
def test_colocated_row(models, worker_b, prefix):
    """Colocated: the engine slept after generation; the sync wakes it, loads B, resets the cache."""

    async def run():
        client = LocalClient(AsyncEngine(make_engine(models, enable_prefix_caching=prefix)))
        dispatch = WorkerDispatch([worker_b], client, InProcessTransport(), row_config("colocated", prefix))
        report, after = await colocated_sync(client, dispatch)
        await client.engine.close()
        return dispatch.plan, report, after

    plan, report, after = asyncio.run(run())
    check_colocated(asdict(report), plan, prefix, after, models.hf_b)

