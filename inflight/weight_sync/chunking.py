"""HF-named tensors in size-bounded chunks, with the metadata a receiver needs to rebuild them.

A chunk is a list of `TensorMeta` (name, dtype, shape, where its bytes sit in a flat buffer) and,
on the sending side, the tensors themselves. Transports that move bytes through one flat buffer of
fixed capacity (shared memory, broadcast) may split a tensor larger than the buffer into pieces
(flat element ranges); the receiver hands each piece to the engine, which copies it straight into
its place (`inflight.engine.weight_copy.WeightPiece`); `Reassembler` puts pieces back together for
what the engine takes only whole (LoRA adapter tensors). Everything in the metadata is
JSON-friendly: it travels over a control channel, not with the bytes.

A chunk's tensors are the sender's own (no copy is made when chunking); a `dtype` cast happens in
the one copy into the flat buffer (`pack_chunk`), so an update allocates nothing on the sender.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch

ALIGN = 64
"""Byte alignment of every tensor in a flat buffer (a view as any dtype needs at least its size)."""

DEFAULT_CHUNK_BYTES = 256 * 2**20


def dtype_name(dtype: torch.dtype) -> str:
    """`torch.bfloat16` -> `"bfloat16"`."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    """`"bfloat16"` -> `torch.bfloat16`; raises ValueError for anything that is not a torch dtype."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{name!r} is not a torch dtype")
    return dtype


def align(offset: int) -> int:
    return -(-offset // ALIGN) * ALIGN


@dataclass(frozen=True)
class TensorMeta:
    """One tensor, or one piece of it, in a chunk.

    `offset` is the byte offset of its data in the chunk's flat buffer; `start` and `numel` are the
    flat element range of the full tensor this entry carries (a whole tensor: `start == 0` and
    `numel == prod(shape)`).
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    start: int
    numel: int

    @property
    def total_numel(self) -> int:
        return math.prod(self.shape)

    @property
    def whole(self) -> bool:
        return self.start == 0 and self.numel == self.total_numel

    @property
    def nbytes(self) -> int:
        return self.numel * dtype_from_name(self.dtype).itemsize

    def to_json(self) -> list:
        return [self.name, self.dtype, list(self.shape), self.offset, self.start, self.numel]

    @classmethod
    def from_json(cls, data: list) -> TensorMeta:
        name, dtype, shape, offset, start, numel = data
        return cls(name, dtype, tuple(shape), offset, start, numel)


@dataclass
class WeightChunk:
    """A size-bounded group of tensors (or pieces): metadata, and on the sender the tensors."""

    index: int
    metas: list[TensorMeta] = field(default_factory=list)
    # the sender's tensors (flat pieces when split), not yet cast to their entry's dtype
    tensors: list[torch.Tensor] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        """Bytes of the flat buffer this chunk occupies (alignment included)."""
        return max((m.offset + m.nbytes for m in self.metas), default=0)

    @property
    def payload_bytes(self) -> int:
        return sum(m.nbytes for m in self.metas)

    def named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """The chunk as (name, tensor) pairs for `load_weights`; only for chunks of whole tensors."""
        if not all(m.whole for m in self.metas):
            raise ValueError("this chunk carries pieces of split tensors; use a Reassembler")
        return [
            (m.name, t.to(dtype_from_name(m.dtype))) for m, t in zip(self.metas, self.tensors, strict=True)
        ]

    def metadata(self) -> dict:
        return {"index": self.index, "nbytes": self.nbytes, "tensors": [m.to_json() for m in self.metas]}


def chunk_metas(data: dict) -> list[TensorMeta]:
    """The inverse of `WeightChunk.metadata()["tensors"]`."""
    return [TensorMeta.from_json(t) for t in data["tensors"]]


def check_entries(metas: list[TensorMeta], nbytes: int) -> None:
    """Raise ValueError, naming the entry, unless every entry is a torch dtype's aligned range of
    elements of its tensor that lies inside a flat buffer of `nbytes` (what a receiver checks of a
    chunk's metadata before it reads the buffer)."""
    for m in metas:
        try:
            itemsize = dtype_from_name(m.dtype).itemsize
        except ValueError as err:
            raise ValueError(f"tensor {m.name!r}: {err}") from None
        fits = min(m.shape, default=1) >= 0 and m.start >= 0 and m.numel >= 0
        fits = fits and m.offset >= 0 and m.offset % itemsize == 0  # a view needs aligned data
        if not fits or m.start + m.numel > m.total_numel or m.offset + m.nbytes > nbytes:
            raise ValueError(f"tensor {m.name!r}: entry {m.to_json()} does not fit a chunk of {nbytes} bytes")


def iter_chunks(named_tensors: Iterable[tuple[str, torch.Tensor]], max_chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                split: bool = False, dtype: torch.dtype | None = None) -> Iterator[WeightChunk]:
    """Group tensors into chunks of at most `max_chunk_bytes` (alignment included), in order.

    A tensor larger than `max_chunk_bytes` travels alone in its own chunk, or, with `split`, in
    pieces across consecutive chunks. `dtype` is the dtype floating-point tensors are sent in
    (e.g. bfloat16 to a bfloat16 engine: half the bytes), cast by `pack_chunk` or
    `named_tensors`. Lazy: consumes `named_tensors` one tensor at a time, so a trainer can
    gather each tensor just in time.
    """
    if max_chunk_bytes < ALIGN:
        raise ValueError(f"max_chunk_bytes={max_chunk_bytes} must be at least {ALIGN}")
    chunk, used = WeightChunk(0), 0
    for name, tensor in named_tensors:
        tensor = tensor.detach()
        wire = dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype
        shape, total, itemsize = tuple(tensor.shape), tensor.numel(), wire.itemsize
        if not split or total * itemsize <= max_chunk_bytes:
            if chunk.metas and used + total * itemsize > max_chunk_bytes:
                yield chunk
                chunk, used = WeightChunk(chunk.index + 1), 0
            chunk.metas.append(TensorMeta(name, dtype_name(wire), shape, used, 0, total))
            chunk.tensors.append(tensor)
            used = align(used + total * itemsize)
            continue
        flat = tensor.reshape(-1)
        start = 0
        while start < total:
            # not below 0: `used` is aligned up, and may pass a max_chunk_bytes that is not a
            # multiple of ALIGN (a negative room walked `start` backwards forever: issue 18, #10)
            room = max(0, (max_chunk_bytes - used) // itemsize)
            if room == 0:
                yield chunk
                chunk, used = WeightChunk(chunk.index + 1), 0
                continue
            numel = min(room, total - start)
            chunk.metas.append(TensorMeta(name, dtype_name(wire), shape, used, start, numel))
            chunk.tensors.append(flat[start : start + numel])
            used = align(used + numel * itemsize)
            start += numel
    if chunk.metas:
        yield chunk


def pack_chunk(chunk: WeightChunk, buffer: torch.Tensor) -> int:
    """Copy the chunk's tensors into a flat uint8 `buffer` at their offsets, cast to their entries'
    dtypes in the same pass; returns bytes used."""
    if chunk.nbytes > buffer.numel():
        raise ValueError(f"chunk needs {chunk.nbytes} bytes, the buffer holds {buffer.numel()}")
    for meta, tensor in zip(chunk.metas, chunk.tensors, strict=True):
        dst = buffer[meta.offset : meta.offset + meta.nbytes].view(dtype_from_name(meta.dtype))
        dst.view(tensor.shape if meta.whole else (-1,)).copy_(tensor)
    return chunk.nbytes


def view_entry(meta: TensorMeta, buffer: torch.Tensor) -> torch.Tensor:
    """The entry's data in `buffer`, as a view: the full shape when whole, else flat."""
    flat = buffer[meta.offset : meta.offset + meta.nbytes].view(dtype_from_name(meta.dtype))
    return flat.view(meta.shape) if meta.whole else flat


class Reassembler:
    """Receiving side, for what the engine takes only whole (LoRA adapter tensors): turns a
    chunk's entries into whole (name, tensor) pairs.

    Whole tensors come back as views of the buffer (no copy: the engine copies them on load).
    Pieces of a split tensor are copied into a tensor of the full shape, which is returned with
    the chunk that carries its last piece.
    """

    def __init__(self) -> None:
        self._pending: dict[str, tuple[torch.Tensor, int]] = {}  # name -> (flat tensor, elements so far)

    def add(self, metas: list[TensorMeta], buffer: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        out = []
        for meta in metas:
            data = view_entry(meta, buffer)
            if meta.whole:
                out.append((meta.name, data))
                continue
            full, done = self._pending.get(meta.name, (None, 0))
            if full is None:
                full = torch.empty(meta.total_numel, dtype=data.dtype, device=data.device)
            full[meta.start : meta.start + meta.numel].copy_(data)
            done += meta.numel
            if done == meta.total_numel:
                self._pending.pop(meta.name, None)
                out.append((meta.name, full.view(meta.shape)))
            else:
                self._pending[meta.name] = (full, done)
        return out

    @property
    def incomplete(self) -> list[str]:
        """Names of split tensors still missing pieces."""
        return sorted(self._pending)

    def clear(self) -> None:
        self._pending.clear()
