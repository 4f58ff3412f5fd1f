"""The broadcast group on the vLLM backend: the native server's routes (`inflight/server/weight_transfer.py`)
over the group protocol's own member (`GroupMember` of `inflight/weight_sync/group.py`, loaded by path:
`shared.py`), with each chunk staged like a chunk-route chunk (`weights.WeightStage`).

`POST /init_weight_update_communicator` (alias `/init_weight_transfer`) joins the group a trainer's
rank 0 (`GroupHost`) hosts, at the rank the body gives (SkyRL's body); a wrong world size or backend
is a 400, an unreachable master a 502, a group that does not form a 504; a join replaces the group
in place only once the new one has formed (409 with `override_existing=false`).
`POST /weight_update/broadcast` carries one chunk's metadata: once the body is well formed and a
group exists, the server always joins the chunk's broadcast (a rank that skipped one would put the
group out of step), and only then refuses what the update cannot take (no update open, unknown
names, wrong shapes, NaN: the update stays all-or-nothing). A failed broadcast drops the group.
`POST /destroy_weights_update_group` leaves it.

The group's buffer lives where the backend needs it: host memory for gloo, the CUDA device for nccl
(a CUDA build of vLLM); staged tensors are copied to host memory either way, as the chunk route's are.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any, Literal

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field

from .errors import APIError, state_error
from .shared import chunking, group
from .state import OPEN, Lifecycle
from .weights import WeightStage


class InitBody(BaseModel):
    """Body of the init route (SkyRL's `init_weight_update_communicator` fields, as the native server's)."""

    model_config = ConfigDict(extra="ignore")

    master_address: str = Field(min_length=1)
    master_port: int = Field(ge=1, le=65535)
    rank_offset: int = Field(ge=1)
    world_size: int = Field(ge=2)
    group_name: str = Field(group.DEFAULT_WEIGHT_GROUP, min_length=1)
    backend: Literal["gloo", "nccl"] | None = None
    override_existing: bool = False
    timeout_s: float = Field(600.0, gt=0, le=86400)


class ChunkBody(BaseModel):
    """Body of the broadcast route: one chunk's metadata, as `WeightChunk.metadata()` writes it."""

    index: int = 0
    nbytes: int = Field(ge=1)
    tensors: list[tuple[str, str, list[int], int, int, int]] = Field(min_length=1)

    def metas(self) -> list[Any]:
        """The entries (`chunking.TensorMeta`), checked to fit `nbytes` (400 naming the entry)."""
        metas = chunking.chunk_metas({"tensors": self.tensors})
        try:
            chunking.check_entries(metas, self.nbytes)
        except ValueError as err:
            raise APIError(400, str(err), param="tensors", code="invalid_value") from err
        return metas


class BroadcastMember:
    """This server's place in a trainer's weight group (at most one). A lock keeps the group calls
    in arrival order; they block, so the routes run them in daemon threads."""

    def __init__(self, device: str = "cpu") -> None:
        self.device = device  # vLLM's device: where an nccl group's buffer goes
        self.member: Any = None  # group.GroupMember
        self._lock = threading.Lock()

    def buffer_device(self, backend: str | None) -> str:
        """Host memory for gloo and on a CPU server (where GroupMember refuses nccl, naming the
        backend), else this server's CUDA device (nccl, or no backend named: rank 0's)."""
        return "cpu" if backend == "gloo" or not self.device.startswith("cuda") else "cuda"

    def join(self, request: dict[str, Any]) -> dict[str, Any]:
        """Join the group `request` describes (`GroupHost.init_request`), replacing the one in place
        only once the new one has formed (blocking)."""
        group.GroupMember.check_rank(request)
        with self._lock:
            if self.member is not None and not request.get("override_existing", True):
                raise group.WeightGroupError(
                    f"this server is already in weight group {self.member.group_name!r}; "
                    "pass override_existing=true or destroy it first",
                    409,
                    "weight_transfer_group_exists",
                )
            import torch

            self.member = group.GroupMember.join(
                request, torch.device(self.buffer_device(request.get("backend")))
            )
            return self.member.describe()

    def receive(self, nbytes: int, consume: Callable[[Any], Any]) -> Any:
        """Join the broadcast of one chunk of `nbytes` (blocking), then `consume(bytes)` before the
        next chunk can overwrite the buffer; returns what `consume` returns."""
        with self._lock:
            member = self.member
            if member is None:
                raise group.WeightGroupError(
                    "this server is in no weight broadcast group; call "
                    "init_weight_transfer() (/init_weight_update_communicator) first",
                    409,
                    "no_weight_transfer_group",
                )
            try:
                buffer = member.receive(nbytes)
            except group.WeightGroupError:
                raise
            except RuntimeError as err:
                self.member = None
                raise group.WeightGroupError("the weight broadcast failed; the group is dropped and must be "
                                             f"re-initialised: {err}") from err
            return consume(buffer[:nbytes])

    def leave(self) -> bool:
        """Leave the group; True when there was one."""
        with self._lock:
            had, self.member = self.member is not None, None
            return had

    def describe(self) -> dict[str, Any] | None:
        member = self.member
        return None if member is None else member.describe()


async def _blocking(fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)` in a daemon thread (a collective whose peers never come blocks until the group's
    timeout, and must not hold up the server's exit); a `WeightGroupError` answered with its own
    status and code."""
    try:
        return await group.in_daemon_thread(fn, *args)
    except group.WeightGroupError as err:
        raise APIError(err.status, str(err), code=err.code, param=err.param) from err


def add_broadcast_routes(router: APIRouter, guarded: list, life: Lifecycle, stage: WeightStage,
                         member: BroadcastMember, routes: Any) -> None:
    """The broadcast-group routes (paths from `routes`, i.e. inflight/client/routes.py)."""

    async def init_weight_transfer(body: InitBody) -> dict[str, Any]:
        """Join the trainer's weight broadcast group; answers once every rank has joined."""
        return {"success": True, **await _blocking(member.join, body.model_dump())}

    for path in (routes.INIT_WEIGHT_TRANSFER, routes.INIT_WEIGHT_TRANSFER_ALIAS):
        router.add_api_route(path, init_weight_transfer, methods=["POST"], dependencies=guarded)

    @router.post(routes.WEIGHTS_BROADCAST, dependencies=guarded)
    async def load_weights_broadcast(body: ChunkBody) -> dict[str, Any]:
        """Receive one chunk over the group (between begin and finish) and stage what it completes."""
        metas = body.metas()

        def take(buffer: Any) -> int:
            if life.update != OPEN:  # after the broadcast: this rank took part in it all the same
                raise state_error(f"no weight update is open (state {life.update!r}): call begin first")
            life.update_touched = time.monotonic()  # the lease runs from the last chunk
            return stage.stage_chunk(metas, buffer)

        return {"success": True, "num_tensors": await _blocking(member.receive, body.nbytes, take)}

    @router.post(routes.DESTROY_WEIGHT_TRANSFER, dependencies=guarded)
    async def destroy_weight_transfer() -> dict[str, Any]:
        return {"success": True, "destroyed": await asyncio.to_thread(member.leave)}
