"""Shared-memory transport: a real engine in another process (spawn) and one in this process's
thread receive the same update; torch is the oracle (every received parameter torch.equal to the
sent tensor), transformers checks the engine generates with the new weights."""

from __future__ import annotations

import asyncio
import contextlib
import json
import multiprocessing as mp
import os
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from inflight.engine import EngineConfig, LLMEngine, SamplingParams, WeightUpdateError
from inflight.engine.models.loader import iter_safetensors
from inflight.testing.oracle import hf_greedy
from inflight.weight_sync import ShmReceiver, ShmTransport, shm

SMALL = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    vocab_size=384,
)  # fmt: skip
CHUNK = 16 * 1024  # the embedding (48 KiB) and LM head travel in pieces
PROMPT = [5, 17, 99, 3, 250, 42]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def engine_process(
    kind: str, host: str, port: int, rank: int, receivers: int, model_dir: str, out: str
) -> None:
    """Child: an engine on `model_dir` serving updates until the sender closes, then its parameters
    and a greedy generation are written to `out` (safetensors + json)."""
    torch.set_num_threads(1)
    if kind == "broadcast":  # the engine's own default group must not get in the way
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"file://{out}.pg", rank=0, world_size=1)
        from inflight.weight_sync import BroadcastReceiver as receiver_cls
    else:
        receiver_cls = ShmReceiver
    engine = LLMEngine(EngineConfig(model=model_dir, block_size=4))
    receiver = receiver_cls(host, port, rank=rank, num_receivers=receivers, timeout=120)
    receiver.serve(engine)
    save_file({n: p.detach().contiguous() for n, p in engine.model.named_parameters()}, out)
    tokens = engine.generate([PROMPT], GREEDY)[0].output_token_ids
    Path(out + ".json").write_text(json.dumps({"tokens": tokens, "version": engine.weight_version}))


@pytest.fixture(scope="module")
def model_dirs(tiny_model_factory):
    return tiny_model_factory("qwen2", seed=0, **SMALL), tiny_model_factory("qwen2", seed=1, **SMALL)


async def send_update(transport, weights: dict[str, torch.Tensor], version: int) -> int:
    """One update as the sync executor sends it: staged (when the transport stages), then sent."""
    update = await transport.stage(weights.items())
    await transport.begin(None)
    for chunk in transport.chunks(update):
        await transport.send_chunk(None, chunk)
    return await transport.finish(None, version)


@contextlib.contextmanager
def served_engine(model_dir, **transport_options):
    """An engine on `model_dir` served by a ShmReceiver thread from a fresh ShmTransport (the
    sender): yields (engine, transport, receiver)."""
    engine = LLMEngine(EngineConfig(model=str(model_dir), block_size=4))
    with ShmTransport(port=0, max_chunk_bytes=CHUNK, **{"timeout": 60, **transport_options}) as transport:
        receiver = ShmReceiver("127.0.0.1", transport.port)
        receiver.serve_in_thread(engine)
        yield engine, transport, receiver


def send_chunks(transport, update) -> int:
    """begin, then every chunk of `update` (staged or tensors); returns how many chunks went."""
    asyncio.run(transport.begin(None))
    sent = 0
    for chunk in transport.chunks(update):
        asyncio.run(transport.send_chunk(None, chunk))
        sent += 1
    return sent


async def failed_update(transport, weights: dict[str, torch.Tensor]) -> bool:
    """Half an update, then a chunk the engines refuse; returns what abort says."""
    items = sorted(weights.items())
    await transport.begin(None)
    for chunk in transport.chunks(items[: len(items) // 2]):
        await transport.send_chunk(None, chunk)
    name, tensor = items[-1]
    with pytest.raises(WeightUpdateError, match=name.replace(".", r"\.")):
        for chunk in transport.chunks([(name, tensor[:1])]):
            await transport.send_chunk(None, chunk)
        await transport.finish(None, 99)  # a pipelined transport (shm) reports it by the finish at the latest
    return await transport.abort(None)


def run_two_engines(kind: str, make_transport, make_local_receiver, model_dirs, hf_model_factory, tmp_path):
    """Engine 1 in a spawned process, engine 2 in a thread here; both on model A, updated to B."""
    dir_a, dir_b = model_dirs
    weights_a = dict(iter_safetensors(dir_a))
    weights_b = {n: t.clone() for n, t in iter_safetensors(dir_b)}
    out = str(tmp_path / "engine1.safetensors")
    transport = make_transport()
    child = mp.get_context("spawn").Process(
        target=engine_process, args=(kind, "127.0.0.1", transport.port, 1, 2, str(dir_a), out)
    )
    child.start()
    local = LLMEngine(EngineConfig(model=str(dir_a), block_size=4))
    box = {}

    def serve_local():
        box["receiver"] = make_local_receiver(transport.port)
        box["receiver"].serve(local)

    thread = threading.Thread(target=serve_local, daemon=True)
    thread.start()
    try:
        assert asyncio.run(send_update(transport, weights_b, version=1)) == 1
        assert asyncio.run(failed_update(transport, weights_a)) is True  # both engines back on B
        assert local.weight_version == 1 and local.can_run  # restored: the engine may run again
    finally:
        transport.close()
        child.join(120)
        if child.is_alive():
            child.kill()
    thread.join(30)
    assert child.exitcode == 0
    received = load_file(out)
    params = dict(local.model.named_parameters())
    for name, tensor in weights_b.items():
        assert torch.equal(received[name], tensor), name
        assert torch.equal(params[name], tensor), name
    result = json.loads(Path(out + ".json").read_text())
    assert result["version"] == 1
    assert result["tokens"] == hf_greedy(hf_model_factory(dir_b), PROMPT, 8)[0]
    assert box["receiver"].updates == 1
    return transport


@pytest.mark.parametrize("staged", [True, False], ids=["staged", "pipelined"])
def test_shm_transport_updates_engines_in_two_processes(staged, model_dirs, hf_model_factory, tmp_path):
    transport = run_two_engines(
        "shm",
        lambda: ShmTransport(port=0, num_receivers=2, max_chunk_bytes=CHUNK, timeout=120, staged=staged),
        lambda port: ShmReceiver("127.0.0.1", port, rank=2, num_receivers=2),
        model_dirs, hf_model_factory, tmp_path,
    )  # fmt: skip
    assert len(transport.slots) > shm.MIN_SLOTS if staged else len(transport.slots) == shm.MIN_SLOTS
    assert transport.paths and not any(os.path.exists(p) for p in transport.paths)  # unlinked on close


@pytest.mark.parametrize("staged", [True, False], ids=["staged", "pipelined"])
def test_shm_buffers_are_allocated_once_and_reused(staged, model_dirs):
    dir_a, _ = model_dirs
    weights = {n: t.clone() for n, t in iter_safetensors(dir_a)}
    with served_engine(dir_a, staged=staged) as (engine, transport, receiver):
        assert asyncio.run(send_update(transport, weights, 1)) == 1
        pointers = [slot.buffer.data_ptr() for slot in transport.slots]
        for version in (2, 3):
            assert asyncio.run(send_update(transport, weights, version)) == version
        assert [slot.buffer.data_ptr() for slot in transport.slots] == pointers  # no slot made again
        assert sorted(receiver.slots) == list(range(len(pointers)))  # the engine mapped each slot once
        packs = sorted(int(slot.pack.item()) for slot in transport.slots)
        assert packs[-1] == transport._packs and len(set(packs)) == len(packs)  # each holds its own pack
    receiver._thread.join(10)
    assert not receiver._thread.is_alive()
    assert engine.weight_version == 3


def test_a_staged_update_is_packed_before_the_engines_are_told_anything(model_dirs):
    """Staging packs every chunk without a message (the engines are not paused yet and hear
    nothing); the send then only posts the messages, and the update lands bit for bit."""
    dir_a, dir_b = model_dirs
    weights = {n: t.clone() for n, t in iter_safetensors(dir_b)}
    with served_engine(dir_a) as (engine, transport, _):
        update = asyncio.run(transport.stage(sorted(weights.items())))
        assert transport.channel.seq == 0 and engine.weight_version == 0  # no message posted
        packs = transport._packs
        assert packs == len(transport.slots) > shm.MIN_SLOTS  # one slot per chunk, all packed
        send_chunks(transport, update)
        assert transport._packs == packs  # sending packed nothing more
        assert asyncio.run(transport.finish(None, 1)) == 1
    assert_params_equal(engine, weights)


def test_staging_without_room_packs_the_rest_during_the_pause(model_dirs, monkeypatch):
    """When shared memory is short the ring does not grow: what does not fit is packed as it is
    sent, through the two slots, and the update still lands bit for bit."""
    monkeypatch.setattr(shm, "_available_memory", lambda: shm.RESERVE_BYTES)  # no room beyond the reserve
    dir_a, dir_b = model_dirs
    weights = {n: t.clone() for n, t in iter_safetensors(dir_b)}
    with served_engine(dir_a) as (engine, transport, _):
        update = asyncio.run(transport.stage(sorted(weights.items())))
        assert transport._packs == shm.MIN_SLOTS == len(transport.slots)
        chunks = send_chunks(transport, update)
        assert chunks > shm.MIN_SLOTS and transport._packs == chunks
        assert asyncio.run(transport.finish(None, 1)) == 1
    assert_params_equal(engine, weights)


def test_a_staged_update_that_is_never_sent_does_not_leak_into_the_next(model_dirs):
    """A sync that failed between staging and sending (e.g. the pause) leaves packed slots behind;
    the next update, staged or not, sends its own bytes."""
    dir_a, dir_b = model_dirs
    weights_a = {n: t.clone() for n, t in iter_safetensors(dir_a)}
    weights_b = {n: t.clone() for n, t in iter_safetensors(dir_b)}
    with served_engine(dir_a) as (engine, transport, _):
        asyncio.run(transport.stage(sorted(weights_a.items())))  # never sent
        assert asyncio.run(send_update(transport, weights_b, 1)) == 1
    assert_params_equal(engine, weights_b)


def assert_params_equal(engine: LLMEngine, weights: dict[str, torch.Tensor]) -> None:
    params = dict(engine.model.named_parameters())
    for name, tensor in weights.items():
        resolved = engine.model.resolve(name)
        if resolved is not None:
            assert torch.equal(params[resolved], tensor), name


def test_the_sender_packs_the_next_chunk_while_the_engine_copies_the_last(model_dirs):
    """Pipelined, two slots: with the engine stuck copying chunk 0, chunk 1 is packed and posted; chunk 2
    (into chunk 0's slot) waits for chunk 0's answer. The update still lands bit for bit."""
    dir_a, dir_b = model_dirs
    engine = LLMEngine(EngineConfig(model=str(dir_a), block_size=4))
    weights = {n: t.clone() for n, t in iter_safetensors(dir_b)}
    release, copying = threading.Event(), threading.Event()
    with ShmTransport(port=0, max_chunk_bytes=CHUNK, timeout=60, staged=False) as transport:
        receiver = ShmReceiver("127.0.0.1", transport.port)
        read = receiver.chunk_buffer

        def slow_first_read(message):
            if not copying.is_set():
                copying.set()
                assert release.wait(60)
            return read(message)

        receiver.chunk_buffer = slow_first_read
        receiver.serve_in_thread(engine)
        chunks = list(transport.chunks(sorted(weights.items())))
        assert len(chunks) >= 3
        asyncio.run(transport.begin(None))
        asyncio.run(transport.send_chunk(None, chunks[0]))
        assert copying.wait(60)
        asyncio.run(transport.send_chunk(None, chunks[1]))  # returns with chunk 0 unanswered
        assert len(transport._in_flight) == 2
        third = threading.Thread(target=lambda: asyncio.run(transport.send_chunk(None, chunks[2])))
        third.start()
        third.join(0.5)
        assert third.is_alive()  # chunk 0's slot is still being read
        release.set()
        third.join(60)
        for chunk in chunks[3:]:
            asyncio.run(transport.send_chunk(None, chunk))
        assert asyncio.run(transport.finish(None, 1)) == 1
    assert_params_equal(engine, weights)


@pytest.mark.parametrize("staged", [True, False], ids=["staged", "pipelined"])
def test_a_refused_chunk_is_reported_once_and_no_answer_is_awaited_twice(staged, model_dirs):
    """The chunk the engine refuses is collected once: the wait for answers that were already read
    (their keys deleted) ran to the transport's whole timeout before the error reached the caller."""
    dir_a, _ = model_dirs
    weights = {n: t.clone() for n, t in iter_safetensors(dir_a)}
    with served_engine(dir_a, timeout=3, staged=staged) as (engine, transport, _):
        collected: list[int] = []
        collect = transport.channel.collect
        transport.channel.collect = lambda posted, timeout=None: (
            collected.append(posted.seq) or collect(posted, timeout)
        )
        assert asyncio.run(failed_update(transport, weights)) is True
        assert len(collected) == len(set(collected)), f"messages collected more than once: {collected}"
        assert engine.weight_version == 0 and engine.can_run  # back on its weights, free to run
        assert asyncio.run(send_update(transport, weights, 1)) == 1  # the transport still works
