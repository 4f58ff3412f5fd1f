"""Shared-memory transport: trainer and engine processes on one host.

The sender allocates ONE flat buffer in shared memory (a file under /dev/shm mapped by
`torch.from_file(shared=True)`) when the transport is made, and reuses it for every chunk of every
update: re-sharing tensors each step (a `torch.multiprocessing` queue) costs more than it saves
(measured on 2 CPU cores). A chunk is packed into the buffer with one memcpy per tensor;
its first 8 bytes hold a version counter (the sequence number of the message that describes the
bytes), so a receiver never reads a buffer that was overwritten or not yet written. The metadata
travels over the control channel; the receiver rebuilds the tensors as views of its own mapping of
the same buffer and calls the engine's `load_weights`, which copies them into the parameters.

On CUDA the same protocol would carry a CUDA tensor shared once through its IPC handle
(`torch.multiprocessing.reductions.reduce_tensor`, rebuilt with `rebuild_cuda_tensor` on the
engine's device) instead of a /dev/shm file; that path is not implemented here.
"""

from __future__ import annotations

import os
import tempfile
import uuid
import weakref
from pathlib import Path

import torch

from inflight.weight_sync.chunking import ALIGN, DEFAULT_CHUNK_BYTES, WeightChunk, pack_chunk
from inflight.weight_sync.receiver import ChannelReceiver
from inflight.weight_sync.transport import ChannelTransport, ControlChannel, TransportError

HEADER = ALIGN  # bytes before the data: an int64 version counter, padded to the alignment


def _shm_dir() -> Path:
    return Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


class ShmTransport(ChannelTransport):
    """Sender: packs chunks into the shared buffer; lifecycle and metadata over the control channel.

    `host`/`port`: where this sender hosts the control store (receivers connect to it).
    `max_chunk_bytes` is the buffer's capacity; larger tensors are sent in pieces.
    """

    name = "shm"
    split_tensors = True

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        num_receivers: int = 1,
        max_chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        dtype: torch.dtype | None = None,
        timeout: float = 600.0,
        path: str | None = None,
    ) -> None:
        super().__init__(max_chunk_bytes, dtype)
        self.path = path or str(_shm_dir() / f"inflight-weights-{uuid.uuid4().hex}")
        self.buffer = torch.from_file(
            self.path, shared=True, size=HEADER + self.max_chunk_bytes, dtype=torch.uint8
        )
        self._finalizer = weakref.finalize(self, _unlink, self.path)
        self.version = self.buffer[:8].view(torch.int64)
        self.data = self.buffer[HEADER:]
        self.channel = ControlChannel(host, port, num_receivers, rank=0, timeout=timeout)
        self.port = self.channel.store.port  # the port actually bound (port=0 picks a free one)
        self.channel.store.set("shm/info", f"{self.path}\n{self.max_chunk_bytes}")

    def _send_bytes(self, chunk: WeightChunk, message: dict) -> list:
        pack_chunk(chunk, self.data)
        self.version.fill_(self.channel.seq)  # the seq of the message about to describe these bytes
        return self.channel.send_checked(message)

    def close(self) -> None:
        if self._finalizer.alive:
            self.close_receivers()
            self._finalizer()


class ShmReceiver(ChannelReceiver):
    """Engine side: maps the sender's buffer and loads views of it into the engine."""

    def __init__(
        self, host: str, port: int, rank: int = 1, num_receivers: int = 1, timeout: float = 600.0
    ) -> None:
        super().__init__(ControlChannel(host, port, num_receivers, rank=rank, timeout=timeout))
        path, capacity = self.channel.store.get("shm/info").decode().split("\n")
        self.path = path
        self.buffer = torch.from_file(path, shared=True, size=HEADER + int(capacity), dtype=torch.uint8)
        self.version = self.buffer[:8].view(torch.int64)
        self.data = self.buffer[HEADER:]

    def chunk_buffer(self, message: dict) -> torch.Tensor:
        if int(self.version.item()) != message["seq"]:
            raise TransportError(
                f"shared buffer holds the bytes of message {int(self.version.item())}, not {message['seq']}"
            )
        return self.data
