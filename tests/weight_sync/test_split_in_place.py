"""Split weights land piece by piece straight in the engine's destination (issue 20, goal 2).

A real `Receiver` and `LLMEngine` in this thread, chunks packed into a plain buffer as a transport
packs its slot; torch is the oracle (bit-for-bit equality, torch's own casts, torch's profiler for
what is allocated). The shared-memory path end to end, against transformers, is in
test_transport_shm.py (its chunks split the embedding too).
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from inflight.engine import EngineConfig, LLMEngine, WeightUpdateError
from inflight.engine.models.loader import iter_safetensors
from inflight.weight_sync.chunking import iter_chunks, pack_chunk
from inflight.weight_sync.receiver import Receiver

SMALL = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    vocab_size=384,
)  # fmt: skip
CHUNK = 16 * 1024  # the embedding (48 KiB in float32) travels in 3+ pieces
EMBED = "model.embed_tokens.weight"


@pytest.fixture(scope="module")
def weights(tiny_model_factory):
    dir_a, dir_b = tiny_model_factory("qwen2", seed=0, **SMALL), tiny_model_factory("qwen2", seed=1, **SMALL)
    return (
        dir_a,
        {n: t.clone() for n, t in iter_safetensors(dir_a)},
        {n: t.clone() for n, t in iter_safetensors(dir_b)},
    )


def _engine(model_dir, **overrides) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model_dir), block_size=4, **overrides))


def _chunks(tensors: dict[str, torch.Tensor], dtype: torch.dtype | None = None):
    return list(iter_chunks(sorted(tensors.items()), CHUNK, split=True, dtype=dtype))


def _load(receiver: Receiver, chunks, buffer: torch.Tensor) -> None:
    for chunk in chunks:
        pack_chunk(chunk, buffer)
        receiver.load(chunk.metas, buffer)


def _update(receiver: Receiver, tensors, buffer, version: int, dtype: torch.dtype | None = None) -> None:
    receiver.begin()
    _load(receiver, _chunks(tensors, dtype), buffer)
    assert receiver.finish(version) == version


def _params(engine: LLMEngine) -> dict[str, torch.Tensor]:
    return dict(engine.model.named_parameters())


def _assert_holds(engine: LLMEngine, tensors: dict[str, torch.Tensor]) -> None:
    params = _params(engine)
    for name, tensor in tensors.items():
        resolved = engine.model.resolve(name)
        if resolved is not None:
            assert torch.equal(params[resolved], tensor.to(params[resolved].dtype)), name


def test_a_split_weight_lands_in_place_with_no_temporary(weights):
    """The embedding is split; each piece is copied into the spare buffer that becomes the
    parameter, so from the second update on nothing of a weight's size is allocated at all."""
    dir_a, weights_a, weights_b = weights
    assert sum(m.name == EMBED for c in _chunks(weights_b) for m in c.metas) >= 3
    engine = _engine(dir_a)
    receiver, buffer = Receiver(engine), torch.empty(CHUNK, dtype=torch.uint8)
    first_storage = _params(engine)[EMBED].data_ptr()
    _update(receiver, weights_b, buffer, 1)  # the first update fills fresh storage; A's becomes the spare
    _assert_holds(engine, weights_b)
    receiver.begin()
    chunks = _chunks(weights_a)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        _load(receiver, chunks, buffer)
    allocated = [e.cpu_memory_usage for e in prof.events() if e.cpu_memory_usage > 0]
    assert max(allocated, default=0) < CHUNK // 2, allocated  # no weight-sized temporary, no fresh storage
    assert receiver.finish(2) == 2
    _assert_holds(engine, weights_a)
    assert _params(engine)[EMBED].data_ptr() == first_storage  # the pieces landed in the spare


def test_pieces_land_in_the_destination_as_they_arrive(weights):
    """Between two pieces the live parameter is untouched and the received elements sit in the
    destination buffer the parameter then gets."""
    dir_a, weights_a, weights_b = weights
    engine = _engine(dir_a)
    receiver, buffer = Receiver(engine), torch.empty(CHUNK, dtype=torch.uint8)
    live = _params(engine)[EMBED].data_ptr()
    receiver.begin()
    chunks = _chunks(weights_b)
    first = next(i for i, c in enumerate(chunks) if any(m.name == EMBED for m in c.metas))
    _load(receiver, chunks[: first + 1], buffer)
    meta = next(m for m in chunks[first].metas if m.name == EMBED)
    assert not meta.whole
    pending = engine._update.pieces[EMBED]
    assert pending.filled == meta.numel and pending.dest.data_ptr() != live
    assert torch.equal(pending.dest.view(-1)[: meta.numel], weights_b[EMBED].view(-1)[: meta.numel])
    assert torch.equal(_params(engine)[EMBED], weights_a[EMBED]) and _params(engine)[EMBED].data_ptr() == live
    _load(receiver, chunks[first + 1 :], buffer)
    assert receiver.finish(1) == 1
    assert _params(engine)[EMBED].data_ptr() == pending.dest.data_ptr()
    _assert_holds(engine, weights_b)


def test_nan_in_the_second_piece_leaves_the_live_weight_untouched(weights):
    dir_a, weights_a, weights_b = weights
    engine = _engine(dir_a)
    receiver, buffer = Receiver(engine), torch.empty(CHUNK, dtype=torch.uint8)
    live = _params(engine)[EMBED].data_ptr()
    bad = dict(weights_b)
    bad[EMBED] = weights_b[EMBED].clone()
    chunks = _chunks(bad)
    pieces = [m for c in chunks for m in c.metas if m.name == EMBED]
    bad[EMBED].view(-1)[pieces[1].start + 3] = float("nan")  # the chunks hold views of it
    receiver.begin()
    with pytest.raises(WeightUpdateError, match=f"{EMBED}.*NaN"):
        _load(receiver, chunks, buffer)
    embed = _params(engine)[EMBED]
    assert embed.data_ptr() == live and torch.equal(embed, weights_a[EMBED])
    assert EMBED not in engine._update.pieces  # the refused weight's spare is free for the next one
    assert receiver.abort() is True and engine.can_run
    _assert_holds(engine, weights_a)
    _update(receiver, weights_b, buffer, 1)  # the next complete update lands
    _assert_holds(engine, weights_b)


def test_out_of_order_and_unfinished_pieces_are_refused(weights):
    dir_a, weights_a, weights_b = weights
    engine = _engine(dir_a)
    receiver, buffer = Receiver(engine), torch.empty(CHUNK, dtype=torch.uint8)
    chunks = _chunks(weights_b)
    first = next(i for i, c in enumerate(chunks) if any(m.name == EMBED for m in c.metas))
    receiver.begin()
    _load(receiver, chunks[:first], buffer)
    with pytest.raises(WeightUpdateError, match="arrive in order"):
        _load(receiver, chunks[first + 1 : first + 2], buffer)  # the embedding's first piece skipped
    receiver.begin()  # a restart forgets pieces
    last = max(i for i, c in enumerate(chunks) if any(m.name == EMBED for m in c.metas))
    _load(receiver, [c for i, c in enumerate(chunks) if i != last], buffer)
    with pytest.raises(WeightUpdateError, match="never completed"):
        receiver.finish(1)
    assert receiver.abort() is True
    _assert_holds(engine, weights_a)


@pytest.mark.parametrize("wire", [None, torch.bfloat16])
def test_float32_pieces_cast_into_a_bfloat16_engine(weights, wire):
    """float32 on the wire (the engine casts each piece) or bfloat16 (cast while packing): the
    engine holds torch's own bfloat16 rounding of every weight."""
    dir_a, _, weights_b = weights
    engine = _engine(dir_a, dtype="bfloat16")
    receiver, buffer = Receiver(engine), torch.empty(CHUNK, dtype=torch.uint8)
    _update(receiver, weights_b, buffer, 1, dtype=wire)
    _assert_holds(engine, weights_b)


def test_without_rollback_pieces_are_copied_into_the_parameter_itself(weights):
    dir_a, _, weights_b = weights
    engine = _engine(dir_a, weight_update_rollback=False)
    receiver, buffer = Receiver(engine), torch.empty(CHUNK, dtype=torch.uint8)
    storage = {n: p.data_ptr() for n, p in _params(engine).items()}
    _update(receiver, weights_b, buffer, 1)
    _assert_holds(engine, weights_b)
    assert {n: p.data_ptr() for n, p in _params(engine).items()} == storage
    receiver.begin()
    chunks = _chunks(weights_b)
    first = next(i for i, c in enumerate(chunks) if any(m.name == EMBED for m in c.metas))
    _load(receiver, chunks[: first + 1], buffer)  # the embedding half overwritten, in place
    assert receiver.abort() is False and not engine.can_run


def test_the_sender_casts_while_packing_and_copies_nothing_before(weights):
    _, _, weights_b = weights
    chunks = _chunks(weights_b, dtype=torch.bfloat16)
    buffer = torch.empty(CHUNK, dtype=torch.uint8)
    sources = {t.untyped_storage().data_ptr(): n for n, t in weights_b.items()}
    for chunk in chunks:
        assert all(t.untyped_storage().data_ptr() in sources for t in chunk.tensors)  # the sender's own
        pack_chunk(chunk, buffer)
        for meta in chunk.metas:
            assert meta.dtype == "bfloat16"
            sent = buffer[meta.offset : meta.offset + meta.nbytes].view(torch.bfloat16)
            expected = weights_b[meta.name].to(torch.bfloat16).view(-1)[meta.start : meta.start + meta.numel]
            assert torch.equal(sent, expected), meta.name
    assert sum(m.numel for c in chunks for m in c.metas) == sum(
        math.prod(t.shape) for t in weights_b.values()
    )
