"""A sync whose transport fails half-way (a real transport that raises after N chunks): the update
is aborted, generation resumes on the old weights with the version unchanged, and no request is
lost. Where the plan slept the engine (the old weights were dropped), the engine stays paused
instead of running half-updated, and the next successful sync brings every request home."""

from __future__ import annotations

import asyncio

import pytest
from conftest_weights import hf_greedy, make_engine
from sync_scenarios import PROMPTS, FailingTransport, check_fate, row_config, start_in_flight

from inflight.client import LocalClient
from inflight.engine import AsyncEngine
from inflight.train import LocalPolicy
from inflight.weight_sync import InProcessTransport, TransportError


@pytest.mark.parametrize("row", ["async-keep", "async-clear"])
def test_failed_send_resumes_on_old_weights(models, worker_b, row):
    async def run():
        engine = make_engine(models, enable_prefix_caching=True)
        client = LocalClient(AsyncEngine(engine))
        tasks = await start_in_flight(client, engine)
        policy = LocalPolicy(
            row_config(row, True), worker_b, client, FailingTransport(3, max_chunk_bytes=8192)
        )
        with pytest.raises(TransportError, match="after 3 chunks") as err:
            await policy.sync_weights()
        paused_after = engine.is_paused
        outputs = {rid: await task for rid, task in tasks.items()}
        await client.engine.close()
        return engine, policy, err.value, paused_after, outputs

    engine, policy, err, paused_after, outputs = asyncio.run(run())
    assert not paused_after and engine.weight_version == 0 and policy.weight_version == 0
    assert policy.failed_syncs == 1 and engine.stats.resets == 0 and engine.stats.weight_updates == 0
    assert not getattr(err, "__notes__", None)  # restored: nothing to warn about
    for rid, out in outputs.items():  # every request finished, entirely on model A
        assert out.finish_reason == "length" and set(out.token_weight_versions) == {0}
        assert out.output_token_ids == hf_greedy(models.hf_a, PROMPTS[rid], len(out.output_token_ids))
        assert out.num_recomputed_tokens == 0


@pytest.mark.parametrize(("row", "fate"), [("async-clear-offload", "recompute"), ("async-offload", "keep")])
def test_failed_send_after_sleep_stays_paused_until_a_complete_update(models, worker_b, row, fate):
    async def run():
        engine = make_engine(models, enable_prefix_caching=False)
        client = LocalClient(AsyncEngine(engine))
        tasks = await start_in_flight(client, engine)
        cfg = row_config(row, False)
        failing = LocalPolicy(cfg, worker_b, client, FailingTransport(2, max_chunk_bytes=8192))
        with pytest.raises(TransportError) as err:
            await failing.sync_weights()
        state = (engine.is_paused, engine.kv_cache.awake, engine.weights.awake, engine.weight_version)
        await asyncio.sleep(0.05)
        assert not any(t.done() for t in tasks.values()), "a request ran on half-updated weights"
        policy = LocalPolicy(cfg, worker_b, client, InProcessTransport(max_chunk_bytes=8192))
        report = await policy.sync_weights()
        outputs = {rid: await task for rid, task in tasks.items()}
        await client.engine.close()
        return engine, err.value, state, report, outputs

    engine, err, state, report, outputs = asyncio.run(run())
    assert state == (True, True, True, 0)  # paused, both pools awake again, old version
    assert any("stay unable to run" in note for note in err.__notes__)
    assert any("stay paused" in note for note in err.__notes__)
    assert report.ok and report.version == engine.weight_version == 1
    check_fate(outputs, fate, models.hf_a, models.hf_b)
