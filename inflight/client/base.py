"""InferenceClient: what a trainer needs from its inference engines, local or remote."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol, runtime_checkable

import torch

from inflight.client.wire import DEFAULT_WEIGHT_GROUP
from inflight.engine.request import RequestOutput, SamplingParams


@runtime_checkable
class InferenceClient(Protocol):
    """Generation plus the weight-sync lifecycle (docs/design.md section 5), as coroutines.

    Written once as operations (`inflight.client.ops.OpClient`): `LocalClient` runs them on an
    in-process AsyncEngine, `ProcessClient` / `RayEngineClient` send them to an engine in another
    process, `RemoteClient` over HTTP, `FanOutClient` to several engines. All raise the engine's error classes (InvalidRequestError, EngineStateError,
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

    async def stats(self) -> dict[str, int]:
        """The engines' counters (`EngineStats.as_dict()`, summed over engines); {} when the engines
        do not report them (an HTTP server)."""
        ...

    async def init_weight_transfer(
        self,
        master_address: str = "127.0.0.1",
        master_port: int = 0,
        *,
        backend: str | None = None,
        group_name: str = DEFAULT_WEIGHT_GROUP,
        device: str | torch.device = "cpu",
        max_chunk_bytes: int | None = None,
        dtype: torch.dtype | None = None,
        timeout_s: float = 600.0,
        override_existing: bool = True,
    ) -> dict[str, Any]:
        """Form a weight broadcast group: this process is rank 0 (hosting the rendezvous at
        master_address:master_port, 0 for a free port), every engine joins at ranks 1..N. Returns
        the group's description. In process there is nothing to join."""
        ...

    async def load_weights_broadcast(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """`load_weights` with the bytes over the broadcast group (between begin and finish)."""
        ...

    async def update_weights_broadcast(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int | None = None
    ) -> int:
        """begin → load_weights_broadcast → finish, all or nothing: on any failure the update is
        aborted (the engines go back to their old weights where they can) and the error re-raised."""
        ...

    async def close_weight_transfer(self) -> None:
        """Leave the broadcast group (every engine and this process)."""
        ...

    async def close(self) -> None: ...


async def update_weights(
    client: InferenceClient, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int | None = None
) -> int:
    """begin → load_weights → finish on any client; returns the new weight version."""
    await client.begin_weight_update()
    await client.load_weights(named_tensors)
    return await client.finish_weight_update(version)

