"""Chunking: size bounds, order, metadata round trips, and bytes back bit-exact (torch as the oracle)."""

from __future__ import annotations

import json

import pytest
import torch

from inflight.weight_sync.chunking import (
    ALIGN,
    Reassembler,
    TensorMeta,
    chunk_metas,
    iter_chunks,
    pack_chunk,
)


def _tensors() -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    return [
        ("model.embed_tokens.weight", torch.randn(97, 13, generator=gen)),  # 5044 bytes: split at 1 KiB
        ("model.norm.weight", torch.randn(13, generator=gen)),
        ("scalar", torch.tensor(3.5)),
        ("empty", torch.empty(0, 4)),
        ("bf16", torch.randn(7, 5, generator=gen).to(torch.bfloat16)),
        ("ints", torch.arange(33, dtype=torch.int64).view(3, 11)),
        ("mask", torch.rand(9, generator=gen) > 0.5),
        ("transposed", torch.randn(6, 4, generator=gen).t()),  # not contiguous
    ]


def _roundtrip(chunks, capacity: int) -> dict[str, torch.Tensor]:
    buffer = torch.empty(capacity, dtype=torch.uint8)
    receiver = Reassembler()
    out: dict[str, torch.Tensor] = {}
    for chunk in chunks:
        metas = chunk_metas(json.loads(json.dumps(chunk.metadata())))  # as over the control channel
        assert metas == chunk.metas
        pack_chunk(chunk, buffer)
        for name, tensor in receiver.add(metas, buffer):
            assert name not in out
            out[name] = tensor.clone()  # the views are overwritten by the next chunk
    assert receiver.incomplete == []
    return out


@pytest.mark.parametrize("max_bytes", [ALIGN, 1024, 4096, 1 << 20])
def test_split_chunks_are_bounded_and_come_back_bit_exact(max_bytes):
    tensors = _tensors()
    chunks = list(iter_chunks(tensors, max_bytes, split=True))
    assert [c.index for c in chunks] == list(range(len(chunks)))
    assert all(c.nbytes <= max_bytes for c in chunks)
    assert all(m.offset % ALIGN == 0 for c in chunks for m in c.metas)
    out = _roundtrip(chunks, max_bytes)
    assert list(out) == [name for name, _ in tensors]  # order kept
    for name, tensor in tensors:
        assert out[name].dtype == tensor.dtype and out[name].shape == tensor.shape
        assert torch.equal(out[name], tensor), name
    if max_bytes == 1024:
        pieces = [m for c in chunks for m in c.metas if m.name == "model.embed_tokens.weight"]
        assert len(pieces) == 5 and not any(p.whole for p in pieces)
        assert sum(p.numel for p in pieces) == 97 * 13


def test_unsplit_chunks_keep_whole_tensors_and_put_large_ones_alone():
    tensors = _tensors()
    chunks = list(iter_chunks(tensors, 1024, split=False))
    embed = [c for c in chunks if any(m.name == "model.embed_tokens.weight" for m in c.metas)]
    assert len(embed) == 1 and len(embed[0].metas) == 1 and embed[0].nbytes > 1024
    assert all(c.nbytes <= 1024 for c in chunks if c is not embed[0])
    pairs = [pair for c in chunks for pair in c.named_tensors()]
    assert [n for n, _ in pairs] == [n for n, _ in tensors]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(pairs, tensors, strict=True))


def test_dtype_cast_applies_to_floating_point_only():
    chunks = list(iter_chunks(_tensors(), 1 << 20, dtype=torch.bfloat16))
    metas = {m.name: m for c in chunks for m in c.metas}
    assert metas["model.norm.weight"].dtype == "bfloat16"
    assert metas["ints"].dtype == "int64" and metas["mask"].dtype == "bool"


def test_named_tensors_refuses_pieces_and_metadata_is_json():
    chunk = next(iter_chunks([("w", torch.zeros(100))], 128, split=True))
    with pytest.raises(ValueError, match="Reassembler"):
        chunk.named_tensors()
    meta = chunk.metas[0]
    assert TensorMeta.from_json(json.loads(json.dumps(meta.to_json()))) == meta
    with pytest.raises(ValueError, match="at least"):
        list(iter_chunks([("w", torch.zeros(1))], 8))


@pytest.mark.timeout(60)  # the old code never returned from one chunk (it filled memory instead)
@pytest.mark.parametrize("max_bytes", [ALIGN + 1, 1000, 52428])  # 52428: weight_sync_chunk_size_mb=0.05
def test_a_chunk_size_that_is_not_a_multiple_of_the_alignment_still_ends(max_bytes):
    """Issue 18 finding 10: with max_chunk_bytes not a multiple of ALIGN the aligned offset could
    pass it, the room went negative and the split loop walked backwards forever (21 GB, 100% CPU)."""
    import itertools

    tensors = _tensors() + [("big", torch.randn(30000, generator=torch.Generator().manual_seed(1)))]
    chunks = list(itertools.islice(iter_chunks(tensors, max_bytes, split=True), 10_000))
    assert len(chunks) < 10_000, "the chunker did not end"
    assert all(0 < c.nbytes <= max_bytes for c in chunks) and all(
        m.numel >= 0 for c in chunks for m in c.metas
    )
    out = _roundtrip(chunks, max_bytes)
    for name, tensor in tensors:
        assert torch.equal(out[name], tensor), name
