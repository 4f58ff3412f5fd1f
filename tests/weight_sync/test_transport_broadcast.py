"""Broadcast transport: a torch.distributed group (gloo) between this sender and two engine ranks,
one in a spawned process that also has a default process group of its own, one in a thread here.
torch is the oracle: every received parameter is torch.equal to the sent tensor."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch
from test_transport_shm import CHUNK, SMALL, run_two_engines, send_update

from inflight.engine import EngineConfig, LLMEngine
from inflight.engine.models.loader import iter_safetensors
from inflight.weight_sync import BroadcastReceiver, BroadcastTransport, TransportError


@pytest.fixture(scope="module")
def model_dirs(tiny_model_factory):
    return tiny_model_factory("qwen2", seed=0, **SMALL), tiny_model_factory("qwen2", seed=1, **SMALL)


def test_broadcast_transport_updates_engines_in_two_processes(model_dirs, hf_model_factory, tmp_path):
    transport = run_two_engines(
        "broadcast",
        lambda: BroadcastTransport("127.0.0.1", 0, num_receivers=2, max_chunk_bytes=CHUNK, timeout=120),
        lambda port: BroadcastReceiver("127.0.0.1", port, rank=2, num_receivers=2, timeout=120),
        model_dirs, hf_model_factory, tmp_path,
    )  # fmt: skip
    assert transport.backend == "gloo" and transport.group is None  # closed


def test_stopped_receiver_is_reported_not_waited_for(model_dirs):
    dir_a, _ = model_dirs
    engine = LLMEngine(EngineConfig(model=str(dir_a), block_size=4))
    weights = {n: t.clone() for n, t in iter_safetensors(dir_a)}
    transport = BroadcastTransport("127.0.0.1", 0, max_chunk_bytes=CHUNK, timeout=60)
    box = {}

    def serve():
        box["receiver"] = BroadcastReceiver("127.0.0.1", transport.port, timeout=60)
        box["receiver"].serve(engine)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    assert asyncio.run(send_update(transport, weights, 1)) == 1
    box["receiver"].stop()  # from the engine's side
    thread.join(10)
    assert not thread.is_alive()
    with pytest.raises(TransportError, match="stopped"):
        asyncio.run(send_update(transport, weights, 2))
    transport.close()
    assert engine.weight_version == 1
    assert torch.equal(
        dict(engine.model.named_parameters())["model.norm.weight"], weights["model.norm.weight"]
    )
