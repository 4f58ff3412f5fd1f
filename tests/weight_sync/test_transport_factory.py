"""The transport factory: the configured backend (and SkyRL's names for it), host, port and chunk
size give the right sender, and the sender with its spec's receiver moves a real update into a
real engine (torch as the oracle: every parameter torch.equal to the sent tensor)."""

from __future__ import annotations

import asyncio
import socket
import threading
from contextlib import contextmanager

import pytest
import torch
from test_transport_shm import SMALL

from inflight.client import LocalClient
from inflight.config import load_config
from inflight.engine import AsyncEngine, EngineConfig, LLMEngine
from inflight.engine.models.loader import iter_safetensors
from inflight.testing import LOCAL_CPU
from inflight.weight_sync import (
    BroadcastReceiver,
    BroadcastTransport,
    InProcessTransport,
    ShmReceiver,
    ShmTransport,
    configured_transport,
    make_transport,
    transport_spec,
)
from inflight.weight_sync.factory import MIB, chunk_bytes

IE = "generator.inference_engine."
CLASSES = {"inprocess": InProcessTransport, "shm": ShmTransport, "broadcast": BroadcastTransport}
RECEIVERS = {"shm": ShmReceiver, "broadcast": BroadcastReceiver}


def _cfg(backend: str, *extra: str):
    return load_config(None, [*LOCAL_CPU, f"{IE}weight_sync_backend={backend}", *extra])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def model_dirs(tiny_model_factory):
    return tiny_model_factory("qwen2", seed=0, **SMALL), tiny_model_factory("qwen2", seed=1, **SMALL)


@contextmanager
def connected(cfg):
    """The configured sender with its spec's receiver connected to it (serving no engine: it only
    has to take part until the sender closes)."""
    transport = make_transport(cfg, timeout=30)
    spec, box = configured_transport(cfg), {}

    def serve() -> None:
        box["receiver"] = spec.build_receiver("127.0.0.1", transport.port, timeout=30)
        box["receiver"].serve(None)

    thread = threading.Thread(target=serve, daemon=True)
    if not spec.in_trainer_process:
        thread.start()
        if spec.forms_group:
            transport.connect()
    try:
        yield transport
    finally:
        transport.close()
    if not spec.in_trainer_process:
        thread.join(30)
        assert not thread.is_alive()
        assert type(box["receiver"]) is RECEIVERS[spec.name]


@pytest.mark.parametrize(
    ("backend", "kind"),
    [("inprocess", "inprocess"), ("shm", "shm"), ("cuda_ipc", "shm"), ("broadcast", "broadcast"),
     ("nccl", "broadcast"), ("gloo", "broadcast")],
)  # fmt: skip
def test_each_backend_name_gives_its_transport_and_receiver(backend, kind):
    cfg = _cfg(backend, f"{IE}weight_sync_chunk_size_mb=0.5")
    assert configured_transport(cfg) is transport_spec(kind)
    assert configured_transport(cfg).name == kind
    with connected(cfg) as transport:
        assert type(transport) is CLASSES[kind]
        assert transport.max_chunk_bytes == MIB // 2


@pytest.mark.parametrize("backend", ["shm", "broadcast"])
def test_sender_listens_on_the_configured_host_and_port(backend):
    port = _free_port()
    cfg = _cfg(backend, f"{IE}weight_sync_host=127.0.0.1", f"{IE}weight_sync_port={port}")
    with connected(cfg) as transport:
        assert (transport.channel.host, transport.port) == ("127.0.0.1", port)


def test_chunk_size_without_a_setting_holds_the_whole_small_model(model_dirs):
    dir_a, _ = model_dirs
    model_bytes = sum(f.stat().st_size for f in dir_a.glob("*.safetensors"))
    assert chunk_bytes(_cfg("shm"), dir_a) == 16 * MIB  # tiny: the floor
    assert model_bytes + MIB <= 16 * MIB
    assert chunk_bytes(_cfg("shm")) == 256 * MIB  # no model to size it from
    assert chunk_bytes(_cfg("shm", f"{IE}weight_sync_chunk_size_mb=2"), dir_a) == 2 * MIB


def test_skyrls_cuda_ipc_threshold_caps_an_shm_chunk(model_dirs):
    dir_a, _ = model_dirs
    threshold = f"{IE}weight_transfer_threshold_cuda_ipc_GB={4 / 1024}"  # 4 MiB
    assert chunk_bytes(_cfg("cuda_ipc", threshold)) == 4 * MIB
    assert chunk_bytes(_cfg("shm", threshold), dir_a) == 4 * MIB
    assert chunk_bytes(_cfg("broadcast", threshold)) == 256 * MIB  # only shm's chunks
    assert chunk_bytes(_cfg("shm", threshold, f"{IE}weight_sync_chunk_size_mb=8")) == 8 * MIB  # ours wins


@pytest.mark.parametrize("backend", ["inprocess", "shm", "broadcast", "gloo"])
def test_factory_pair_moves_an_update_into_an_engine(model_dirs, backend):
    """16 KiB chunks: the embedding and the LM head travel in pieces (shm, broadcast)."""
    dir_a, dir_b = model_dirs
    engine = LLMEngine(EngineConfig(model=str(dir_a), block_size=4))
    weights_b = {n: t.clone() for n, t in iter_safetensors(dir_b)}
    cfg = _cfg(backend, f"{IE}weight_sync_chunk_size_mb={16 / 1024}")
    transport = make_transport(cfg, timeout=60)
    spec = configured_transport(cfg)
    client = LocalClient(AsyncEngine(engine)) if spec.in_trainer_process else None
    thread = None
    if not spec.in_trainer_process:  # the receiver blocks until it reaches the sender: build it in its thread
        serve = lambda: spec.build_receiver("127.0.0.1", transport.port, timeout=60).serve(engine)  # noqa: E731
        thread = threading.Thread(target=serve, daemon=True)
        thread.start()
    try:
        assert asyncio.run(_update(transport, client, weights_b)) == 1
    finally:
        transport.close()
    if thread is not None:
        thread.join(30)
        assert not thread.is_alive()
    params = dict(engine.model.named_parameters())
    assert engine.weight_version == 1
    for name, tensor in weights_b.items():
        assert torch.equal(params[name], tensor), name


async def _update(transport, client, weights: dict[str, torch.Tensor]) -> int:
    """One complete update as version 1 (the channel transports ignore the client)."""
    try:
        await transport.begin(client)
        chunks = list(transport.chunks(weights.items()))
        assert len(chunks) > 1
        for chunk in chunks:
            await transport.send_chunk(client, chunk)
        return await transport.finish(client, 1)
    finally:
        if client is not None:
            await client.engine.close()


def test_inprocess_has_no_receiver_and_unknown_kinds_are_refused():
    with pytest.raises(ValueError, match="the inprocess transport has no receiver"):
        transport_spec("inprocess").build_receiver("127.0.0.1", 0)
    known = r"known: inprocess, shm \(or cuda_ipc\), broadcast \(or nccl, gloo\)"
    with pytest.raises(ValueError, match=r"weight transport 'tcp' is not registered; " + known):
        transport_spec("tcp")
    cfg = _cfg("shm")
    cfg.generator.inference_engine.weight_sync_backend = "tcp"  # set in code, never validated
    with pytest.raises(
        ValueError, match="weight_sync_backend='tcp': weight transport 'tcp' is not registered"
    ):
        make_transport(cfg)
