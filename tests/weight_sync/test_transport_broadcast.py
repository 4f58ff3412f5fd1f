"""Broadcast transport: a torch.distributed group (gloo) between this sender and two engine ranks,
one in a spawned process that also has a default process group of its own, one in a thread here.
torch is the oracle: every received parameter is torch.equal to the sent tensor."""

from __future__ import annotations

import pytest
from test_transport_shm import CHUNK, SMALL, run_two_engines

from inflight.weight_sync import BroadcastReceiver, BroadcastTransport


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
