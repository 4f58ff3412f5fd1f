"""InferenceClient: what a trainer needs from its inference engines, local or remote."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol, runtime_checkable

import torch

from inflight.engine.request import RequestOutput, SamplingParams


@runtime_checkable
class InferenceClient(Protocol):
    """Generation plus the weight-sync lifecycle (docs/design.md section 5), as coroutines.

    `LocalClient` drives an in-process AsyncEngine; `RemoteClient` drives one or more servers over
    HTTP. Both raise the engine's error classes (InvalidRequestError, EngineStateError,
    WeightUpdateError) for the same mistakes.
    """

    async def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        cache_salt: str | None = None,
        session_id: str | None = None,
    ) -> RequestOutput:
        """Generate to completion; blocks across a KEEP pause and weight update. `session_id` keeps
        a multi-turn trajectory on one server (prefix cache); ignored in process."""
        ...

    async def pause(self, mode: str = "keep") -> None: ...

    async def resume(self) -> None: ...

    async def sleep(self, offload_kv: bool = False) -> None: ...

    async def wake_up(self, tags: list[str] | None = None) -> None: ...

    async def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """True iff every engine's prefix cache is now empty."""
        ...

    async def begin_weight_update(self) -> None: ...

    async def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None: ...

    async def finish_weight_update(self, version: int | None = None) -> int: ...

    async def abort_weight_update(self) -> bool:
        """Abandon an update; True iff every engine is back on its pre-update weights."""
        ...

    async def weight_version(self) -> int: ...

    async def close(self) -> None: ...


async def update_weights(
    client: InferenceClient, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int | None = None
) -> int:
    """begin → load_weights → finish on any client; returns the new weight version."""
    await client.begin_weight_update()
    await client.load_weights(named_tensors)
    return await client.finish_weight_update(version)
