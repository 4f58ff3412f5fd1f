"""Weight updates whose bytes arrive over a broadcast group (the server's side).

`POST /init_weight_update_communicator` (alias `/init_weight_transfer`) joins the group that a
trainer's `WeightBroadcaster` hosts: master address:port, this server's rank (`rank_offset`), the
world size, the group name and backend (SkyRL's body). The server checks them against what rank 0
posted in the rendezvous store before it joins, so a wrong world size or backend is a 400 and
nobody waits for a rank that will never come; an unreachable master is a 502, a group that does not
form in time a 504.

`POST /weight_update/broadcast` carries one chunk's metadata (`WeightChunk.metadata()`: names,
dtypes, shapes, offsets in the flat buffer). Once the body is well formed and a group exists, the
server always joins the chunk's broadcast, even when the engine will then refuse the tensors:
skipping a collective would leave this rank out of step with the group for every later chunk.
The rebuilt tensors go to the engine's `load_weights`, so unknown names, wrong shapes and calls
outside begin/finish fail exactly as on the HTTP chunk route (the update stays all-or-nothing). A
broadcast that fails (a peer died, the timeout passed) drops the group: it must be re-initialised.
"""

from __future__ import annotations

import asyncio
import datetime
import json
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as dist
from pydantic import BaseModel, ConfigDict, Field

from inflight.client.broadcast import broadcast_from_root, group_store, info_key, joining_key
from inflight.client.wire import DEFAULT_WEIGHT_GROUP
from inflight.engine.async_engine import AsyncEngine
from inflight.server.errors import APIError
from inflight.weight_sync.broadcast import make_group
from inflight.weight_sync.chunking import Reassembler, TensorMeta, dtype_from_name


class InitWeightTransferRequest(BaseModel):
    """Body of the init route (SkyRL's `init_weight_update_communicator` fields)."""

    model_config = ConfigDict(extra="ignore")

    master_address: str = Field(min_length=1)
    master_port: int = Field(ge=1, le=65535)
    rank_offset: int = Field(ge=1)
    world_size: int = Field(ge=2)
    group_name: str = Field(DEFAULT_WEIGHT_GROUP, min_length=1)
    backend: Literal["gloo", "nccl"] | None = None
    override_existing: bool = False
    timeout_s: float = Field(600.0, gt=0, le=86400)


class BroadcastChunkRequest(BaseModel):
    """Body of the broadcast route: one chunk's metadata, as `WeightChunk.metadata()` writes it."""

    index: int = 0
    nbytes: int = Field(ge=1)
    tensors: list[tuple[str, str, list[int], int, int, int]] = Field(min_length=1)

    def metas(self) -> list[TensorMeta]:
        """The entries, checked to fit the chunk's `nbytes` (raises ValueError naming the entry)."""
        metas = [TensorMeta(n, d, tuple(s), o, st, nu) for n, d, s, o, st, nu in self.tensors]
        for m in metas:
            try:
                dtype_from_name(m.dtype)
            except ValueError as err:
                raise ValueError(f"tensor {m.name!r}: {err}") from None
            itemsize = dtype_from_name(m.dtype).itemsize
            fits = min(m.shape, default=1) >= 0 and m.start >= 0 and m.numel >= 0
            fits = fits and m.offset >= 0 and m.offset % itemsize == 0  # a view needs aligned data
            if not fits or m.start + m.numel > m.total_numel or m.offset + m.nbytes > self.nbytes:
                raise ValueError(
                    f"tensor {m.name!r}: entry {m.to_json()} does not fit a chunk of {self.nbytes} bytes"
                )
        return metas


@dataclass
class GroupMember:
    """This server's rank in one weight broadcast group, with its receive buffer."""

    store: dist.Store
    group: dist.ProcessGroup
    rank: int
    world_size: int
    backend: str
    group_name: str
    buffer: torch.Tensor
    reassembler: Reassembler = field(default_factory=Reassembler)

    def describe(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "world_size": self.world_size,
            "backend": self.backend,
            "group_name": self.group_name,
            "max_chunk_bytes": self.buffer.numel(),
        }

    def receive(self, nbytes: int) -> None:
        """Join one broadcast of `nbytes` into the buffer (blocking)."""
        broadcast_from_root(self.group, self.buffer[:nbytes])

    def tensors(self, metas: list[TensorMeta]) -> list[tuple[str, torch.Tensor]]:
        """The whole tensors the received chunk completes (views of the buffer, or reassembled)."""
        return self.reassembler.add(metas, self.buffer)


def _master_info(store: dist.Store, req: InitWeightTransferRequest, timeout: datetime.timedelta) -> dict:
    key = info_key(req.group_name)
    try:
        store.wait([key], timeout)
        return json.loads(store.get(key))
    except (RuntimeError, ValueError) as err:
        raise APIError(
            504,
            f"the master at {req.master_address}:{req.master_port} has no weight "
            f"group {req.group_name!r} (waited {req.timeout_s:g}s): {err}",
            code="weight_transfer_timeout",
        ) from err


def _check_against_master(req: InitWeightTransferRequest, info: dict, device: torch.device) -> str:
    """The backend to use; a 400 when this request does not describe the master's group."""
    if info.get("world_size") != req.world_size:
        raise APIError(
            400,
            f"world_size={req.world_size} but the group {req.group_name!r} hosted at "
            f"{req.master_address}:{req.master_port} has world_size={info.get('world_size')}",
            param="world_size",
            code="weight_transfer_mismatch",
        )
    backend = req.backend or info.get("backend")
    if backend != info.get("backend"):
        raise APIError(
            400,
            f"backend={backend!r} but the group {req.group_name!r} uses {info.get('backend')!r}",
            param="backend",
            code="weight_transfer_mismatch",
        )
    if backend == "nccl" and device.type != "cuda":
        raise APIError(
            400,
            f"the nccl backend needs a CUDA engine; this engine runs on {device}",
            param="backend",
            code="weight_transfer_mismatch",
        )
    return backend


def join_group(req: InitWeightTransferRequest, device: torch.device) -> GroupMember:
    """Connect to the master's store, check the request against it and join (blocking)."""
    timeout = datetime.timedelta(seconds=req.timeout_s)
    try:
        store = dist.TCPStore(req.master_address, req.master_port, req.world_size, False, timeout=timeout)
    except (RuntimeError, OSError) as err:
        raise APIError(
            502,
            f"cannot reach the weight-transfer master at {req.master_address}:"
            f"{req.master_port} within {req.timeout_s:g}s: {err}",
            code="weight_transfer_unreachable",
        ) from err
    info = _master_info(store, req, timeout)
    backend = _check_against_master(req, info, device)
    store.set(joining_key(req.group_name, req.rank_offset), "1")
    try:
        group = make_group(
            group_store(store, req.group_name), req.rank_offset, req.world_size, backend, timeout
        )
    except RuntimeError as err:
        raise APIError(
            504,
            f"the weight group {req.group_name!r} did not form within {req.timeout_s:g}s "
            f"(are all {req.world_size} ranks joining?): {err}",
            code="weight_transfer_timeout",
        ) from err
    buffer = torch.empty(int(info["max_chunk_bytes"]), dtype=torch.uint8, device=device)
    return GroupMember(store, group, req.rank_offset, req.world_size, backend, req.group_name, buffer)


class WeightTransfer:
    """The server's membership of at most one broadcast group, and the routes' logic over it.

    One asyncio lock serialises init, every chunk (its broadcast and its load: the tensors are
    views of the one receive buffer) and destroy, so collectives run in the order they arrive.
    """

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine
        self.member: GroupMember | None = None
        self._lock = asyncio.Lock()

    def describe(self) -> dict[str, Any] | None:
        return None if self.member is None else self.member.describe()

    async def init(self, req: InitWeightTransferRequest) -> dict[str, Any]:
        """Join the group (returns once every rank has joined); a failed join keeps the old group."""
        if req.rank_offset >= req.world_size:
            raise APIError(
                400,
                f"rank_offset={req.rank_offset} must be below world_size={req.world_size} "
                "(rank 0 is the trainer, the servers take 1..world_size-1)",
                param="rank_offset",
                code="invalid_value",
            )
        async with self._lock:
            if self.member is not None and not req.override_existing:
                raise APIError(
                    409,
                    f"this server is already in weight group {self.member.group_name!r}; "
                    "pass override_existing=true or destroy it first",
                    code="weight_transfer_group_exists",
                )
            # the group in place (if any) is only replaced once the new one has formed
            self.member = await asyncio.to_thread(join_group, req, self.engine.engine.device)
            return self.member.describe()

    async def receive(self, req: BroadcastChunkRequest) -> int:
        """Receive one chunk over the group and load what it completes; returns the tensor count."""
        try:
            metas = req.metas()
        except ValueError as err:
            raise APIError(400, str(err), param="tensors", code="invalid_value") from err
        async with self._lock:
            member = self._member_for(req)
            try:
                await asyncio.to_thread(member.receive, req.nbytes)
            except RuntimeError as err:
                self.member = None
                raise APIError(
                    502,
                    f"the weight broadcast failed; the group is dropped and must be re-initialised: {err}",
                    code="weight_transfer_failed",
                ) from err
            pairs = await asyncio.to_thread(member.tensors, metas)
            if pairs:
                await self.engine.load_weights(pairs)
            return len(pairs)

    def _member_for(self, req: BroadcastChunkRequest) -> GroupMember:
        if self.member is None:
            raise APIError(
                409,
                "this server is in no weight broadcast group; call /init_weight_update_communicator first",
                code="no_weight_transfer_group",
            )
        if req.nbytes > self.member.buffer.numel():
            raise APIError(
                400,
                f"chunk of {req.nbytes} bytes exceeds the group's max_chunk_bytes="
                f"{self.member.buffer.numel()}",
                param="nbytes",
                code="invalid_value",
            )
        return self.member

    def clear_pieces(self) -> None:
        """Forget pieces of split tensors (a new or abandoned update)."""
        if self.member is not None:
            self.member.reassembler.clear()

    async def destroy(self) -> bool:
        """Leave the group; True when there was one."""
        async with self._lock:
            had, self.member = self.member is not None, None
            return had

    def close(self) -> None:
        """Drop the group without waiting for a chunk in progress (server shutdown)."""
        self.member = None


__all__ = [
    "BroadcastChunkRequest",
    "GroupMember",
    "InitWeightTransferRequest",
    "WeightTransfer",
    "join_group",
]
