"""The one all-or-nothing update (`update_all_or_nothing`) and the operations table: a complete
update books its chunks and bytes; a failed one is aborted, says whether the old weights came back
and keeps the engine on them; every protocol operation is declared once with its fan-out rule, and
`status()`, declared that way, answers the same in process, over HTTP and over several engines."""

from __future__ import annotations

import asyncio
import json

import pytest

from inflight.client import FanOutClient, LocalClient, RemoteClient, UpdateProgress, update_all_or_nothing
from inflight.client.base import OPS
from inflight.client.ops import apply_op
from inflight.engine import AsyncEngine, EngineConfig, SamplingParams, WeightUpdateError
from inflight.engine.models.loader import iter_safetensors
from inflight.weight_sync import InProcessTransport

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def test_update_books_its_chunks_and_a_failed_one_is_aborted(model_dir, tiny_model_factory):
    new = list(iter_safetensors(tiny_model_factory("qwen2", seed=1)))

    async def run():
        client = LocalClient(AsyncEngine.from_config(EngineConfig(model=str(model_dir), block_size=4)))
        before = await client.generate([5, 6, 7], GREEDY)
        transport = InProcessTransport(max_chunk_bytes=64 * 1024)
        failed = UpdateProgress()
        with pytest.raises(WeightUpdateError) as err:
            await update_all_or_nothing(client, transport, new[:3], 1, failed)  # incomplete
        kept = await client.generate([5, 6, 7], GREEDY), await client.weight_version()
        done = UpdateProgress()
        version = await update_all_or_nothing(client, transport, new, 2, done)
        await client.engine.close()
        return before, err.value, failed, kept, done, version

    before, err, failed, (kept, old_version), done, version = asyncio.run(run())
    assert failed.restored is True and not getattr(err, "__notes__", None)
    assert kept.output_token_ids == before.output_token_ids and old_version == 0
    assert version == 2 and done.chunks > 1 and done.restored is None
    assert done.bytes == sum(t.numel() * t.element_size() for _, t in new)


def test_every_operation_is_declared_once_with_its_fan_out_rule(model_dir):
    assert set(OPS) == {
        "pause", "resume", "sleep", "wake_up", "reset_prefix_cache", "begin_weight_update", "load_weights",
        "finish_weight_update", "abort_weight_update", "weight_version", "status", "stats",
    }  # fmt: skip
    assert all(o.http is not None for n, o in OPS.items() if n not in ("load_weights", "stats"))

    async def run():
        engine = AsyncEngine.from_config(EngineConfig(model=str(model_dir), block_size=4))
        try:
            with pytest.raises(ValueError, match="unknown engine operation"):
                await apply_op(engine, "shutdown")
            return await apply_op(engine, "stats"), await LocalClient(engine).stats()
        finally:
            await engine.close()

    raw, stats = asyncio.run(run())
    assert raw == stats and "weight_updates" in stats


def test_status_is_one_operation_everywhere(serve, model_dir):
    server = serve()

    async def run():
        engine = AsyncEngine.from_config(EngineConfig(model=str(model_dir), block_size=4))
        try:
            local = await LocalClient(engine).status()
            both = await FanOutClient([LocalClient(engine), LocalClient(engine)]).status()
        finally:
            await engine.close()
        async with RemoteClient(server.url, control_token=server.control_token) as remote:
            await remote.pause("keep")
            paused = (await remote.status())[server.url]  # a fan-out: each server's by URL
            await remote.resume()
        return local, both, paused

    local, both, paused = asyncio.run(run())
    assert local == engine_status_dict(local) and local["paused"] is False and local["weight_version"] == 0
    assert set(both) == {"engine-0", "engine-1"} and both["engine-0"].keys() == local.keys()
    assert paused.keys() == local.keys() and paused["paused"] is True


def engine_status_dict(status: dict) -> dict:
    """A status as plain JSON data (what travels over every channel)."""
    return json.loads(json.dumps(status))
