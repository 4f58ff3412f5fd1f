"""Shared-memory transport: trainer and engine processes on one host.

The sender allocates ONE file in shared memory (under /dev/shm, mapped by
`torch.from_file(shared=True)`) when the transport is made, and reuses it for every chunk of every
update: re-sharing tensors each step (a `torch.multiprocessing` queue) costs more than it saves
(measured on 2 CPU cores). The file holds SLOTS chunk buffers, used in turn, so the sender packs
chunk k+1 while the engine copies chunk k out of the other slot (the sync's pause is then about one
copy of the weights, not two one after the other); a slot is packed again only once the receivers
have answered the message about its last chunk. A chunk is packed into its slot with one memcpy per
tensor; the slot's first 8 bytes hold a version counter (the sequence number of the message that
describes the bytes), so a receiver never reads a slot that was overwritten or not yet written. The
metadata travels over the control channel; the receiver rebuilds the tensors (and pieces of split
ones) as views of its own mapping of the slot and calls the engine's `load_weights`, which copies
each straight into its place in the parameters' storage: with the pack, the only copies.

On CUDA the same protocol would carry a CUDA tensor shared once through its IPC handle
(`torch.multiprocessing.reductions.reduce_tensor`, rebuilt with `rebuild_cuda_tensor` on the
engine's device) instead of a /dev/shm file; that path is not implemented here.
"""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
import uuid
import weakref
from collections import deque
from pathlib import Path
from typing import Any

import torch

from inflight.weight_sync.chunking import ALIGN, DEFAULT_CHUNK_BYTES, WeightChunk, align, pack_chunk
from inflight.weight_sync.receiver import ChannelReceiver
from inflight.weight_sync.transport import ChannelTransport, ControlChannel, Posted, TransportError, checked

HEADER = ALIGN  # bytes before a slot's data: an int64 version counter, padded to the alignment
SLOTS = 2  # chunk buffers in the file: the sender packs one while the engine reads the other


class _Slots:
    """The SLOTS (version counter, data) views of one mapping of the shared file."""

    def __init__(self, path: str, capacity: int) -> None:
        stride = HEADER + align(capacity)  # every slot starts aligned
        self.buffer = torch.from_file(path, shared=True, size=SLOTS * stride, dtype=torch.uint8)
        self.versions = [self.buffer[i * stride : i * stride + 8].view(torch.int64) for i in range(SLOTS)]
        self.data = [self.buffer[i * stride + HEADER : (i + 1) * stride] for i in range(SLOTS)]


SHM_DIR = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
"""Where the weight buffers' shared files live (the temporary directory on a system without /dev/shm)."""


class ShmTransport(ChannelTransport):
    """Sender: packs chunks into the shared buffer; lifecycle and metadata over the control channel.

    `host`/`port`: where this sender hosts the control store (receivers connect to it).
    `max_chunk_bytes` is the buffer's capacity; larger tensors are sent in pieces.
    """

    name = "shm"
    split_tensors = True

    def __init__(self, host: str = "127.0.0.1", port: int = 0, num_receivers: int = 1,
                 max_chunk_bytes: int = DEFAULT_CHUNK_BYTES, dtype: torch.dtype | None = None,
                 timeout: float = 600.0, path: str | None = None) -> None:
        super().__init__(max_chunk_bytes, dtype)
        self.path = path or str(SHM_DIR / f"inflight-weights-{uuid.uuid4().hex}")
        self.slots = _Slots(self.path, self.max_chunk_bytes)
        self._finalizer = weakref.finalize(self, Path(self.path).unlink, missing_ok=True)
        self._next_slot = 0
        self._in_flight: deque[Posted] = deque()  # chunk messages not yet answered, oldest first
        self.channel = ControlChannel(host, port, num_receivers, rank=0, timeout=timeout)
        self.port = self.channel.store.port  # the port actually bound (port=0 picks a free one)
        self.channel.store.set("shm/info", f"{self.path}\n{self.max_chunk_bytes}")

    def _send_bytes(self, chunk: WeightChunk, message: dict) -> list:
        slot, self._next_slot = self._next_slot, (self._next_slot + 1) % SLOTS
        self._settle(keep=SLOTS - 1)  # the slot's last chunk has been answered: it may be packed
        pack_chunk(chunk, self.slots.data[slot])
        self.slots.versions[slot].fill_(self.channel.seq)  # the seq of the message about to describe it
        self._in_flight.append(self.channel.post({**message, "slot": slot}))
        return []

    def _settle(self, keep: int = 0) -> None:
        """Collect answers until at most `keep` chunk messages are unanswered; raises the first
        receiver error (after which nothing is in flight)."""
        while len(self._in_flight) > keep:
            try:
                checked(self.channel.collect(self._in_flight[0]))
            except BaseException:
                self._drop_in_flight()
                raise
            self._in_flight.popleft()

    def _drop_in_flight(self) -> None:
        """After a failure: collect what the receivers still answer, ignoring their errors."""
        while self._in_flight:
            with contextlib.suppress(Exception):  # the failure being handled is the one reported
                self.channel.collect(self._in_flight.popleft())

    async def finish(self, client: Any, version: int) -> int:
        await asyncio.to_thread(self._settle)
        return await super().finish(client, version)

    async def abort(self, client: Any) -> bool:
        await asyncio.to_thread(self._drop_in_flight)
        return await super().abort(client)

    def close(self) -> None:
        if self._finalizer.alive:
            self._in_flight.clear()
            self.close_receivers()
            self._finalizer()


class ShmReceiver(ChannelReceiver):
    """Engine side: maps the sender's buffer and loads views of it into the engine."""

    def __init__(self, host: str, port: int, rank: int = 1, num_receivers: int = 1,
                 timeout: float = 600.0) -> None:
        super().__init__(ControlChannel(host, port, num_receivers, rank=rank, timeout=timeout))
        self.path, capacity = self.channel.store.get("shm/info").decode().split("\n")
        self.slots = _Slots(self.path, int(capacity))

    def chunk_buffer(self, message: dict) -> torch.Tensor:
        slot = int(message.get("slot", 0))
        version = int(self.slots.versions[slot].item())
        if version != message["seq"]:
            raise TransportError(f"shared buffer slot {slot} holds the bytes of message {version}, not {message['seq']}")
        return self.slots.data[slot]
