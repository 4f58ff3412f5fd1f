"""Broadcast transport: a `torch.distributed` group between trainer rank 0 and the engine ranks.

The sender (trainer rank 0) hosts a TCPStore at the host:port it is given; every engine rank (a
`BroadcastReceiver`, ranks 1..N) connects to it. The same store carries the control channel (the
update lifecycle and each chunk's metadata) and, under a prefix of its own, the rendezvous of the
weight-sync process group. That group is built directly as a `ProcessGroupGloo` (CPU) or
`ProcessGroupNCCL` (CUDA) object over the store: it is never registered as torch.distributed's
default group nor created with `new_group`, so it cannot clash with the trainer's own default
group (FSDP's) or the engines' (tensor parallel), and needs no participation from other ranks.

Each chunk is packed into one flat buffer allocated once per side (capacity `max_chunk_bytes`,
larger tensors go in pieces) and moved with a single broadcast from rank 0; receivers rebuild the
tensors as views of their buffer and hand them to the engine's `load_weights`.
"""

from __future__ import annotations

import asyncio
import datetime

import torch
import torch.distributed as dist

from inflight.weight_sync.chunking import DEFAULT_CHUNK_BYTES, WeightChunk, pack_chunk
from inflight.weight_sync.transport import ChannelTransport, ControlChannel, Receiver, metas_of

_GROUP_PREFIX = "inflight/weight-sync/group"


def default_backend(device: torch.device | str) -> str:
    """`nccl` for CUDA buffers, `gloo` otherwise."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def make_group(
    store: dist.Store, rank: int, world_size: int, backend: str, timeout: datetime.timedelta
) -> dist.ProcessGroup:
    """A process group object over `store`, outside torch.distributed's group registry (blocks
    until all `world_size` ranks have joined)."""
    prefixed = dist.PrefixStore(_GROUP_PREFIX, store)
    if backend == "gloo":
        return dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
    if backend == "nccl":  # untested here (no GPU): the documented CUDA path
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, rank, world_size, options)
    raise ValueError(f"weight-sync backend {backend!r} is not one of gloo, nccl")


def _broadcast(group: dist.ProcessGroup, tensor: torch.Tensor) -> None:
    options = dist.BroadcastOptions()
    options.rootRank = 0
    options.rootTensor = 0
    group.broadcast([tensor], options).wait()


class BroadcastTransport(ChannelTransport):
    """Sender (trainer rank 0): hosts the control store at host:port (0: a free port, see `.port`)
    and forms the group with the `num_receivers` engine ranks on `connect()` or the first update."""

    name = "broadcast"
    split_tensors = True

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        num_receivers: int = 1,
        max_chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        device: str | torch.device = "cpu",
        backend: str | None = None,
        dtype: torch.dtype | None = None,
        handles_prefix_cache_reset: bool = False,
        timeout: float = 600.0,
    ) -> None:
        super().__init__(max_chunk_bytes, dtype, handles_prefix_cache_reset)
        self.device = torch.device(device)
        self.backend = backend or default_backend(self.device)
        self.channel = ControlChannel(host, port, num_receivers, rank=0, timeout=timeout)
        self.port = self.channel.store.port
        self.channel.store.set("broadcast/info", f"{self.max_chunk_bytes}\n{self.backend}")
        self.group: dist.ProcessGroup | None = None
        self.buffer = torch.empty(self.max_chunk_bytes, dtype=torch.uint8, device=self.device)
        self._closed = False

    def connect(self) -> None:
        """Form the group with the receivers (blocks until every one has joined); also done by the
        first `begin`. The receivers may be started before or after the transport."""
        if self.group is None:
            size = self.channel.num_receivers + 1
            self.group = make_group(self.channel.store, 0, size, self.backend, self.channel.timeout)

    async def begin(self, client) -> None:
        if self.group is None:
            await asyncio.to_thread(self.connect)
        await super().begin(client)

    def _send_bytes(self, chunk: WeightChunk, message: dict) -> list:
        nbytes = pack_chunk(chunk, self.buffer)
        # The receivers join the broadcast between reading the message and acknowledging it.
        return self.channel.send_checked(message, during=lambda: _broadcast(self.group, self.buffer[:nbytes]))

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            if self.group is not None:
                self.close_receivers()
            self.group = None


class BroadcastReceiver(Receiver):
    """Engine rank `rank` (1..N): joins the group, receives each chunk into its buffer, loads views.
    Construction blocks until the sender connects (make it in the thread that will `serve`)."""

    def __init__(
        self,
        host: str,
        port: int,
        rank: int = 1,
        num_receivers: int = 1,
        device: str | torch.device = "cpu",
        timeout: float = 600.0,
    ) -> None:
        super().__init__(ControlChannel(host, port, num_receivers, rank=rank, timeout=timeout))
        capacity, backend = self.channel.store.get("broadcast/info").decode().split("\n")
        self.device = torch.device(device)
        self.group = make_group(self.channel.store, rank, num_receivers + 1, backend, self.channel.timeout)
        self.buffer = torch.empty(int(capacity), dtype=torch.uint8, device=self.device)

    def receive_chunk(self, message: dict) -> list[tuple[str, torch.Tensor]]:
        _broadcast(self.group, self.buffer[: message["chunk"]["nbytes"]])
        return self.reassembler.add(metas_of(message), self.buffer)
