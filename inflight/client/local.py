"""LocalClient: the InferenceClient protocol over an AsyncEngine in this process."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable
from typing import Any

import torch

from inflight.client.base import InferenceClient
from inflight.client.ops import apply_op
from inflight.client.update import update_all_or_nothing
from inflight.engine.async_engine import AsyncEngine
from inflight.engine.multimodal import MultimodalInput
from inflight.engine.request import RequestOutput, SamplingParams
from inflight.weight_sync.inprocess import InProcessTransport


class LocalClient(InferenceClient):
    """In-process client; the engine's loop must run on the caller's event loop. Weights go to
    the engine as they are (it copies them into its parameters)."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine

    async def _call(self, op: str, *args: Any) -> Any:
        return await apply_op(self.engine, op, *args)

    async def generate_stream(self, prompt_token_ids: list[int], params: SamplingParams | None = None, *,
                              request_id: str | None = None, cache_salt: str | None = None,
                              session_id: str | None = None, multimodal: MultimodalInput | None = None
                              ) -> AsyncIterator[RequestOutput]:
        """The engine's own snapshots, one per step that ran the request."""
        async for snapshot in self.engine.generate_stream(
            list(prompt_token_ids), params, request_id, cache_salt, multimodal
        ):
            yield snapshot

    async def init_weight_transfer(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """Nothing to join: the engine is in this process and takes the tensors directly."""
        return {"world_size": 1, "backend": None, "in_process": True}

    async def update_weights_broadcast(self, named_tensors: Iterable[tuple[str, torch.Tensor]],
                                       version: int | None = None) -> int:
        """begin → load → finish, aborted (old weights back) on failure, as RemoteClient does it."""
        return await update_all_or_nothing(self, InProcessTransport(), named_tensors, version)

    async def close_weight_transfer(self) -> None:
        """Nothing to leave."""

    async def close(self) -> None:
        """Nothing to release: the engine belongs to whoever made it."""
