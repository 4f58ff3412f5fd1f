"""Broadcast transport: a `torch.distributed` group between trainer rank 0 and the engine ranks.

The sender (trainer rank 0) hosts a TCPStore at the host:port it is given; every engine rank (a
`BroadcastReceiver`, ranks 1..N) connects to it. The same store carries the control channel (the
update lifecycle and each chunk's metadata) and the rendezvous of the weight group
(`inflight.weight_sync.group`: the one group sender and member, also used by the clients' own
broadcast calls). Each chunk moves in a single broadcast from rank 0 into one buffer per side;
receivers rebuild the tensors as views of their buffer and hand them to the engine's `load_weights`.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Collection
from typing import Any

import torch
import torch.distributed as dist

from inflight.weight_sync.chunking import DEFAULT_CHUNK_BYTES, WeightChunk
from inflight.weight_sync.group import GroupHost, GroupMember
from inflight.weight_sync.kinds import SenderSite
from inflight.weight_sync.receiver import ChannelReceiver, Receiver
from inflight.weight_sync.transport import (
    ALIVE_CHECK_S,
    ChannelTransport,
    ControlChannel,
    TransportError,
    UpdateClient,
)

_GROUP = "inflight/weight-sync"  # the group's name in the control channel's store


class BroadcastTransport(ChannelTransport):
    """Sender (trainer rank 0): hosts the control store at host:port (0: a free port, see `.port`)
    and forms the group with the `num_receivers` engine ranks on `connect()` or the first update."""

    name = "broadcast"
    split_tensors = True

    def __init__(self, host: str = "127.0.0.1", port: int = 0, num_receivers: int = 1,
                 max_chunk_bytes: int = DEFAULT_CHUNK_BYTES, device: str | torch.device = "cpu",
                 backend: str | None = None, dtype: torch.dtype | None = None,
                 timeout: float = 600.0) -> None:
        super().__init__(max_chunk_bytes, dtype)
        self.channel = ControlChannel(host, port, num_receivers, rank=0, timeout=timeout)
        self.port = self.channel.store.port
        self._group_options = dict(backend=backend, device=device, max_chunk_bytes=self.max_chunk_bytes,
                                   timeout_s=timeout, store=self.channel.store)
        self.sender = GroupHost(num_receivers + 1, host, self.port, group_name=_GROUP, **self._group_options)
        self.backend = self.sender.backend
        self.generation = 0  # groups formed again after a receiver was replaced
        self._regroup = False
        self._formed = False  # a group was formed (one that is gone since must be formed again, anew)
        self._closed = False

    @property
    def group(self) -> dist.ProcessGroup | None:
        """The formed group (None before `connect` and after `close`)."""
        return self.sender.group

    def connect(self) -> None:
        """Form the group with the receivers (blocks until every one has joined); also done by the
        first `begin`. The receivers may be started before or after the transport."""
        self._connect_watching()
        self._formed = True

    def _connect_watching(self) -> None:
        """`self.sender.connect()`, cancelled as soon as a receiver's process is found dead (the
        group's rendezvous would wait its whole timeout for the rank of a process that is gone)."""
        cancel, done = threading.Event(), threading.Event()

        def watch() -> None:
            while not done.wait(ALIVE_CHECK_S):
                dead = self.channel.dead_receivers
                if dead is not None and dead():
                    cancel.set()
                    return

        threading.Thread(target=watch, daemon=True, name="weight-group-watch").start()
        try:
            self.sender.connect(cancel)
        except RuntimeError as err:
            if cancel.is_set():
                raise TransportError(
                    f"a weight-sync receiver's process died while the group formed: {err}"
                ) from None
            raise
        finally:
            done.set()

    async def begin(self, client: UpdateClient | None) -> None:
        if self._regroup or (self.sender.group is None and self._formed):  # replaced or failed: a new group
            await asyncio.to_thread(self.regroup)
        elif self.sender.group is None:
            await asyncio.to_thread(self.connect)
        await super().begin(client)

    def readmit(self, ranks: Collection[int]) -> None:
        """As `ChannelTransport.readmit`; a group with a dead rank cannot broadcast again, so the
        next update first forms a new group with every receiver (`regroup`)."""
        super().readmit(ranks)
        self._regroup = True

    def regroup(self) -> None:
        """Form a new group (a new name in the same store) with every receiver: each joins it on
        the control message, while this side connects."""
        self.generation += 1
        name = f"{_GROUP}/{self.generation}"
        self.sender = GroupHost(self.channel.num_receivers + 1, self.channel.host, self.port, group_name=name,
                                **self._group_options)
        self.channel.send_checked({"op": "regroup", "group_name": name}, during=self._connect_watching)
        self._regroup = False

    def _send_bytes(self, chunk: WeightChunk, message: dict) -> list:
        # The receivers join the broadcast between reading the message and acknowledging it.
        return self.channel.send_checked(message, during=lambda: self.sender.send(chunk))

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            if self._formed:
                self.close_receivers()
            self.sender.group = None


class BroadcastReceiver(ChannelReceiver):
    """Engine rank `rank` (1..N): joins the group, receives each chunk into its buffer, loads views.
    Construction blocks until the sender connects (make it in the thread that will `serve`)."""

    def __init__(self, host: str, port: int, rank: int = 1, num_receivers: int = 1,
                 device: str | torch.device = "cpu", timeout: float = 600.0) -> None:
        super().__init__(ControlChannel(host, port, num_receivers, rank=rank, timeout=timeout))
        self.device = torch.device(device)
        self.request = {"master_address": host, "master_port": port, "rank_offset": rank,
                        "world_size": num_receivers + 1, "group_name": _GROUP, "timeout_s": timeout}
        self.member: GroupMember | None = None
        if not self.channel.readmitted:  # a replacement joins the group formed again for it (`regroup`)
            self.member = GroupMember.join(self.request, self.device, self.channel.store)

    def chunk_buffer(self, message: dict) -> torch.Tensor:
        if self.member is None:
            raise TransportError("this receiver is in no weight broadcast group")
        return self.member.receive(message["chunk"]["nbytes"])

    def _apply(self, receiver: Receiver, message: dict) -> Any:
        if message["op"] == "regroup":
            self.member = None  # the old group had a dead rank
            self.member = GroupMember.join({**self.request, "group_name": message["group_name"]}, self.device,
                                           self.channel.store)
            return None
        return super()._apply(receiver, message)


def build_sender(site: SenderSite) -> BroadcastTransport:
    """The `broadcast` kind's sender (`TransportSpec.sender`)."""
    return BroadcastTransport(
        site.host,
        site.port,
        site.num_receivers,
        site.max_chunk_bytes,
        device=site.device,
        timeout=site.timeout,
    )


def build_receiver(
    host: str,
    port: int,
    *,
    rank: int = 1,
    num_receivers: int = 1,
    device: str | torch.device = "cpu",
    timeout: float = 600.0,
) -> BroadcastReceiver:
    """The `broadcast` kind's receiver (`TransportSpec.receiver`)."""
    return BroadcastReceiver(
        host, port, rank=rank, num_receivers=num_receivers, device=device, timeout=timeout
    )
