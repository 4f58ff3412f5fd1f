"""The engine side of the operations (`apply_op`, on an AsyncEngine: what a process or Ray engine
runs for its client), and `JoiningClient`, the base of the clients whose operations travel to an
engine in another process (`ProcessClient`, `RayEngineClient`)."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from inflight.client import wire
from inflight.client.base import OPS, InferenceClient
from inflight.client.group import GroupMemberClient, HostsWeightGroup
from inflight.engine.async_engine import AsyncEngine
from inflight.engine.multimodal import MultimodalInput
from inflight.engine.request import RequestOutput, SamplingParams
from inflight.weight_sync.receiver import engine_receiver

GROUP_OPS = {"join_weight_group": "join", "receive_weight_chunk": "receive", "leave_weight_group": "leave"}
"""Operations on the engine's membership of a weight broadcast group its client hosts."""


async def apply_op(engine: AsyncEngine, op: str, *args: Any) -> Any:
    """Run one operation (`generate`, one of `OPS` or `GROUP_OPS`) on an AsyncEngine."""
    if op == "generate":
        args = (*args[:4], *[a.unpack() if isinstance(a, PackedImages) else a for a in args[4:5]])
        return await engine.generate(*args)  # prompt, params, id, salt, images; no session: one engine
    if op == "stats":
        return engine.engine.stats.as_dict()
    if op == "weight_version":
        return engine.weight_version
    if op not in OPS and op not in GROUP_OPS:
        raise ValueError(f"unknown engine operation {op!r}")
    if op in GROUP_OPS:
        return await asyncio.to_thread(getattr(engine_receiver(engine), GROUP_OPS[op]), *args)
    if op in ("begin_weight_update", "abort_weight_update"):
        engine_receiver(engine).clear_pieces()
    result = getattr(engine, op)(*args)
    result = await result if inspect.isawaitable(result) else result
    if op == "pause":
        return None
    return result.to_dict() if hasattr(result, "to_dict") else result  # plain data travels


@dataclass(frozen=True)
class PackedImages:
    """A request's images (`MultimodalInput`) as one safetensors buffer, which pickles by value: torch
    pickles a tensor sent through a multiprocessing pipe as a shared-memory handle, which an engine
    child started by `subprocess` (another authentication key) cannot open."""

    data: bytes
    image_hashes: tuple[str, ...] | None

    @classmethod
    def pack(cls, images: MultimodalInput) -> PackedImages:
        return cls(wire.encode_tensors([("pixel_values", images.pixel_values),
                                        ("image_grid_thw", images.image_grid_thw)]), images.image_hashes)

    def unpack(self) -> MultimodalInput:
        tensors = dict(wire.decode_tensors(self.data))
        return MultimodalInput(tensors["pixel_values"], tensors["image_grid_thw"], self.image_hashes)


class JoiningClient(HostsWeightGroup, InferenceClient):
    """A client of one engine in another process: its operations travel by `_call`, and the
    engine can join a weight group this process hosts (at rank 1). `close()` leaves that group;
    whoever started the engine stops it."""

    async def _call(self, op: str, *args: Any) -> Any:
        raise NotImplementedError

    async def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        cache_salt: str | None = None,
        session_id: str | None = None,
        multimodal: MultimodalInput | None = None,
    ) -> RequestOutput:
        """Generate on the engine; the images travel packed (`PackedImages`)."""
        packed = None if multimodal is None else PackedImages.pack(multimodal)
        return await self._call("generate", list(prompt_token_ids), params, request_id, cache_salt, packed)

    async def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The tensors as host copies (they travel pickled)."""
        await self._call("load_weights", [(n, t.detach().cpu()) for n, t in named_tensors])

    def _group_members(self) -> dict[str, GroupMemberClient]:
        return {"engine": self}

    async def join_weight_group(self, request: dict[str, Any]) -> dict[str, Any]:
        """Have the engine join a weight group hosted elsewhere (`GroupHost.init_request`)."""
        return await self._call("join_weight_group", request)

    async def receive_weight_chunk(self, metadata: dict[str, Any]) -> int:
        """Have the engine join one chunk's broadcast and load what it completes."""
        return await self._call("receive_weight_chunk", metadata)

    async def leave_weight_group(self) -> bool:
        return await self._call("leave_weight_group")
