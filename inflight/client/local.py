"""LocalClient: the InferenceClient protocol over an AsyncEngine in this process."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from inflight.client.base import update_all_or_nothing
from inflight.engine.async_engine import AsyncEngine
from inflight.engine.request import RequestOutput, SamplingParams


class LocalClient:
    """In-process client; the engine's loop must run on the caller's event loop."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine

    async def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        cache_salt: str | None = None,
        session_id: str | None = None,
    ) -> RequestOutput:
        return await self.engine.generate(list(prompt_token_ids), params, request_id, cache_salt)

    async def pause(self, mode: str = "keep") -> None:
        await self.engine.pause(mode)

    async def resume(self) -> None:
        await self.engine.resume()

    async def sleep(self, offload_kv: bool = False) -> None:
        await self.engine.sleep(offload_kv)

    async def wake_up(self, tags: list[str] | None = None) -> None:
        await self.engine.wake_up(tags)

    async def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        return await self.engine.reset_prefix_cache(reset_running_requests)

    async def begin_weight_update(self) -> None:
        await self.engine.begin_weight_update()

    async def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        await self.engine.load_weights(named_tensors)

    async def finish_weight_update(self, version: int | None = None) -> int:
        return await self.engine.finish_weight_update(version)

    async def abort_weight_update(self) -> bool:
        return await self.engine.abort_weight_update()

    async def weight_version(self) -> int:
        return self.engine.weight_version

    async def init_weight_transfer(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """Nothing to join: the engine is in this process and takes the tensors directly."""
        return {"world_size": 1, "backend": None, "in_process": True}

    async def load_weights_broadcast(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """In process, the same as `load_weights`."""
        await self.engine.load_weights(named_tensors)

    async def update_weights_broadcast(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int | None = None
    ) -> int:
        """begin → load → finish, aborted (old weights back) on failure, as RemoteClient does it."""
        return await update_all_or_nothing(self, lambda: self.load_weights_broadcast(named_tensors), version)

    async def close_weight_transfer(self) -> None:
        """Nothing to leave."""

    async def close(self) -> None:
        """Nothing to release: the engine belongs to whoever made it."""
