"""Policy rank 0's weight sender (`make_sender`, the one place a run picks it: from the
configured kind's `TransportSpec` and whether the engines are HTTP servers) and where each engine's
receiver connects to it (`receiver_spec`). Into HTTP servers a kind that forms a group is a weight
group the servers' client hosts (`ServerGroupSender`)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from inflight.backends.registry import on_servers
from inflight.client.group import WeightGroup
from inflight.client.process import ReceiverSpec
from inflight.config import Config
from inflight.weight_sync import configured_transport, make_transport
from inflight.weight_sync.chunking import WeightChunk
from inflight.weight_sync.factory import chunk_bytes
from inflight.weight_sync.group import default_backend
from inflight.weight_sync.inprocess import InProcessTransport
from inflight.weight_sync.kinds import TransportSpec
from inflight.weight_sync.transport import ChannelTransport, StagedUpdate, WeightTransport


def make_sender(cfg: Config, model_dir: str | Path, device: str = "cpu",
                host: str | None = None) -> WeightTransport:
    """Policy rank 0's weight sender to all `num_engines` engines: the configured kind's own
    (`make_transport`). HTTP servers take chunks through the client (`RemoteClient(shm_chunks=...)`
    says whether in request bodies or as /dev/shm files: the spec's `chunk_files`), so for them that
    sender hands chunks to the client; a kind that forms a group is, into them, a group the client
    hosts (`ServerGroupSender`)."""
    spec = configured_transport(cfg)
    if on_servers(cfg):
        size = chunk_bytes(cfg, model_dir)
        if spec.forms_group:
            ie = cfg.generator.inference_engine
            return ServerGroupSender(host or ie.weight_sync_host, ie.weight_sync_port, size, device)
        return InProcessTransport(max_chunk_bytes=size)
    return make_transport(cfg, model_dir=model_dir, host=host, device=device,
                          num_receivers=cfg.generator.inference_engine.num_engines)


def receiver_spec(sender: ChannelTransport, transport: TransportSpec, device: str, index: int,
                  num_engines: int) -> ReceiverSpec:
    """Where engine `index` (of `num_engines`) connects its `transport` receiver to `sender`."""
    return ReceiverSpec(transport, sender.channel.host, sender.port, device, index + 1, num_engines)


class ServerGroupSender(WeightTransport):
    """`broadcast` into HTTP servers: a weight group the servers' client hosts
    (`init_weight_transfer`: this process rank 0, server i rank i + 1, each joining through its init
    route), formed by `connect(client)` or the first update, and formed anew before the next update
    when a failed broadcast dropped it. The update's lifecycle goes through the client; each chunk's
    metadata to every server, its bytes in one broadcast from a buffer on `device` (gloo for host
    memory, nccl for a CUDA device: `default_backend`)."""

    name = "broadcast"
    split_tensors = True

    def __init__(self, host: str, port: int, max_chunk_bytes: int, device: str | torch.device = "cpu",
                 timeout_s: float = 600.0) -> None:
        super().__init__(max_chunk_bytes)
        self.host, self.port, self.device, self.timeout_s = host, port, torch.device(device), timeout_s
        self.backend = default_backend(self.device)
        self.group: WeightGroup | None = None
        self.formed = 0  # groups formed so far (a second one: a failed broadcast dropped the first)

    async def connect(self, client: Any) -> dict[str, Any]:
        """Host a new group over every server behind `client` (a RemoteClient); returns once all joined."""
        info = await client.init_weight_transfer(
            self.host,
            self.port,
            backend=self.backend,
            device=self.device,
            max_chunk_bytes=self.max_chunk_bytes,
            dtype=self.dtype,
            timeout_s=self.timeout_s,
        )
        self.group = client.weight_group
        self.formed += 1
        return info

    async def begin(self, client: Any) -> None:
        group = self.group
        if group is None or group.sender is None:  # not formed yet, or dropped by a failed broadcast
            await self.connect(client)
        await super().begin(client)

    def chunks(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]] | StagedUpdate
    ) -> Iterator[WeightChunk]:
        return self._group().chunks(named_tensors)

    async def send_chunk(self, client: Any, chunk: WeightChunk) -> None:
        await self._group().send_chunk(client, chunk)

    def _group(self) -> WeightGroup:
        if self.group is None or self.group.sender is None:
            raise RuntimeError("no weight broadcast group with the servers: begin() forms it")
        return self.group
