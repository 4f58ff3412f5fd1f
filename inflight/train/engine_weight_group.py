"""An engine's rank in a weight broadcast group that its client hosts (the engine side of
`init_weight_transfer` / `load_weights_broadcast` for the process and Ray engine clients).

The client's `WeightBroadcaster` (rank 0) posts the group's size, backend and chunk capacity in its
rendezvous store; the engine checks its request against them, joins at its rank, then for each
chunk joins the broadcast of the bytes into one receive buffer and loads the tensors the chunk
completes. As on the HTTP server, a chunk's broadcast is always joined once the group exists, even
when the engine then refuses the tensors: skipping a collective would put this rank out of step.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import weakref
from typing import Any

import torch
import torch.distributed as dist

from inflight.client.broadcast import broadcast_from_root, group_store, info_key, joining_key
from inflight.engine.errors import EngineStateError
from inflight.weight_sync.broadcast import make_group
from inflight.weight_sync.chunking import Reassembler, chunk_metas

_GROUPS: weakref.WeakKeyDictionary[Any, EngineWeightGroup] = weakref.WeakKeyDictionary()


class WeightGroupError(RuntimeError):
    """Joining a weight broadcast group failed, or a broadcast in it did (the group is dropped)."""


def engine_weight_group(engine: Any) -> EngineWeightGroup:
    """The (one) weight group membership of an AsyncEngine, created on first use."""
    if engine not in _GROUPS:
        _GROUPS[engine] = EngineWeightGroup(engine)
    return _GROUPS[engine]


def _join(request: dict[str, Any], device: torch.device) -> tuple[dist.ProcessGroup, torch.Tensor]:
    """Connect to the host's store, check `request` against what rank 0 posted, join (blocking)."""
    name, rank, size = request["group_name"], request["rank_offset"], request["world_size"]
    timeout = datetime.timedelta(seconds=request.get("timeout_s", 600.0))
    store = dist.TCPStore(request["master_address"], request["master_port"], size, False, timeout=timeout)
    store.wait([info_key(name)], timeout)
    info = json.loads(store.get(info_key(name)))
    backend = request.get("backend") or info["backend"]
    if info["world_size"] != size or backend != info["backend"]:
        raise WeightGroupError(
            f"the request (world_size={size}, backend={backend!r}) does not match the "
            f"group {name!r} hosted at {request['master_address']}:{request['master_port']}: {info}"
        )
    if backend == "nccl" and device.type != "cuda":
        raise WeightGroupError(f"the nccl backend needs a CUDA engine; this engine runs on {device}")
    store.set(joining_key(name, rank), "1")
    group = make_group(group_store(store, name), rank, size, backend, timeout)
    return group, torch.empty(int(info["max_chunk_bytes"]), dtype=torch.uint8, device=device)


class EngineWeightGroup:
    """One engine's membership of at most one group; a lock keeps chunks in arrival order."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.group: dist.ProcessGroup | None = None
        self.buffer: torch.Tensor | None = None
        self.reassembler = Reassembler()
        self._lock = asyncio.Lock()

    async def join(self, request: dict[str, Any]) -> dict[str, Any]:
        """Join the group `request` describes (`WeightBroadcaster.init_request`), replacing any."""
        async with self._lock:
            if self.group is not None and not request.get("override_existing", True):
                raise EngineStateError("this engine is already in a weight broadcast group")
            device = torch.device(self.engine.engine.device)
            try:
                self.group, self.buffer = await asyncio.to_thread(_join, request, device)
            except (RuntimeError, OSError, ValueError) as err:
                raise WeightGroupError(f"joining the weight broadcast group failed: {err}") from err
            self.reassembler = Reassembler()
            return {
                "rank": request["rank_offset"],
                "world_size": request["world_size"],
                "max_chunk_bytes": self.buffer.numel(),
            }

    async def receive(self, metadata: dict[str, Any]) -> int:
        """Join one chunk's broadcast (`WeightChunk.metadata()`), load what it completes; returns
        the number of tensors loaded."""
        async with self._lock:
            if self.group is None:
                raise EngineStateError(
                    "this engine is in no weight broadcast group; call init_weight_transfer()"
                )
            if metadata["nbytes"] > self.buffer.numel():
                raise ValueError(f"chunk of {metadata['nbytes']} bytes exceeds the group's buffer")
            try:
                await asyncio.to_thread(broadcast_from_root, self.group, self.buffer[: metadata["nbytes"]])
            except RuntimeError as err:
                self.group = None
                raise WeightGroupError(f"the weight broadcast failed; the group is dropped: {err}") from err
            pairs = self.reassembler.add(chunk_metas(metadata), self.buffer)
            if pairs:
                await self.engine.load_weights(pairs)
            return len(pairs)

    def clear_pieces(self) -> None:
        """Forget pieces of split tensors (a new or abandoned update)."""
        self.reassembler.clear()

    async def leave(self) -> bool:
        """Leave the group; True when there was one."""
        async with self._lock:
            had, self.group, self.buffer = self.group is not None, None, None
            return had
