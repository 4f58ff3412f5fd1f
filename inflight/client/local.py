"""LocalClient: the InferenceClient protocol over an AsyncEngine in this process."""

from __future__ import annotations

from collections.abc import Iterable

import torch

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

    async def close(self) -> None:
        """Nothing to release: the engine belongs to whoever made it."""
