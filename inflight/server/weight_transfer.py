"""The broadcast-group routes' channel: HTTP in front of the engine's one weight `Receiver`.

`POST /init_weight_update_communicator` (alias `/init_weight_transfer`) joins the group that a
trainer's rank 0 (`inflight.weight_sync.group.GroupHost`) hosts: master address:port, this server's
rank (`rank_offset`), the world size, the group name and backend (SkyRL's body). The receiver checks
them against what rank 0 posted in the rendezvous store before it joins, so a wrong world size or
backend is a 400 and nobody waits for a rank that will never come; an unreachable master is a 502,
a group that does not form in time a 504.

`POST /weight_update/broadcast` carries one chunk's metadata (`WeightChunk.metadata()`: names,
dtypes, shapes, offsets in the flat buffer). Once the body is well formed and a group exists, the
receiver always joins the chunk's broadcast, even when the engine will then refuse the tensors
(unknown names, wrong shapes and calls outside begin/finish fail exactly as on the HTTP chunk
route: the update stays all-or-nothing). A broadcast that fails drops the group.
"""

from __future__ import annotations

import asyncio
from typing import Any, Literal

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field

from inflight.client import wire
from inflight.client.wire import DEFAULT_WEIGHT_GROUP
from inflight.server.errors import APIError
from inflight.weight_sync.chunking import TensorMeta, check_entries
from inflight.weight_sync.receiver import Receiver


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
        check_entries(metas, self.nbytes)
        return metas


def add_weight_transfer_routes(router: APIRouter, guarded: list, receiver: Receiver) -> None:
    """The broadcast-group routes over the engine's receiver, its blocking calls in worker threads
    (a `WeightGroupError` is answered with its own status and code: `server.errors`)."""

    async def init_weight_transfer(body: InitWeightTransferRequest) -> dict[str, Any]:
        """Join the trainer's weight broadcast group; answers once every rank has joined (a failed
        join keeps the old group)."""
        return {"success": True, **await asyncio.to_thread(receiver.join, body.model_dump())}

    for path in (wire.INIT_WEIGHT_TRANSFER, wire.INIT_WEIGHT_TRANSFER_ALIAS):
        router.add_api_route(path, init_weight_transfer, methods=["POST"], dependencies=guarded)

    @router.post(wire.WEIGHTS_BROADCAST, dependencies=guarded)
    async def load_weights_broadcast(body: BroadcastChunkRequest) -> dict[str, Any]:
        """Receive one chunk over the group (between begin and finish) and load what it completes."""
        try:
            body.metas()
        except ValueError as err:
            raise APIError(400, str(err), param="tensors", code="invalid_value") from err
        return {"success": True, "num_tensors": await asyncio.to_thread(receiver.receive, body.model_dump())}

    @router.post(wire.DESTROY_WEIGHT_TRANSFER, dependencies=guarded)
    async def destroy_weight_transfer() -> dict[str, Any]:
        return {"success": True, "destroyed": await asyncio.to_thread(receiver.leave)}


__all__ = ["BroadcastChunkRequest", "InitWeightTransferRequest", "add_weight_transfer_routes"]
