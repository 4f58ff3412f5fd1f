"""FanOutClient: one InferenceClient over several engines' clients (local, process, Ray or HTTP).

Generation goes to one engine chosen by the `Router` (least outstanding requests; a session stays
on its engine so a multi-turn trajectory finds its prefix in that engine's cache). Every control
call (pause, sleep, the weight-update calls, reset, resume) goes to every engine at once and
waits for all of them before it returns or raises: a call that failed on any engine raises
(`FanOutError`, naming each failing engine; the engine's own error when there is one engine), and
the engines where it succeeded have completed it, so the caller (the sync executor) can bring all
of them back to one state with `abort_weight_update` / `resume`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from inflight.client.errors import FanOutError, InconsistentServersError
from inflight.client.router import Router
from inflight.engine.request import RequestOutput, SamplingParams


class FanOutClient:
    """InferenceClient over `clients` (any InferenceClients); `names` label them in errors."""

    def __init__(
        self, clients: Sequence[Any], names: Sequence[str] | None = None, router: Router | None = None
    ) -> None:
        if not clients:
            raise ValueError("FanOutClient needs at least one client")
        self.names = list(names) if names is not None else [f"engine-{i}" for i in range(len(clients))]
        if len(self.names) != len(clients) or len(set(self.names)) != len(self.names):
            raise ValueError(f"need one distinct name per client, got {self.names}")
        self.clients = dict(zip(self.names, clients, strict=True))
        self.router = router or Router(self.names)

    def __len__(self) -> int:
        return len(self.clients)

    async def _all(self, what: str, op: str, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """`op` on every engine concurrently; raise if it failed on any (after all have finished)."""
        results = await asyncio.gather(
            *(getattr(c, op)(*args, **kwargs) for c in self.clients.values()), return_exceptions=True
        )
        errors = {n: r for n, r in zip(self.names, results, strict=True) if isinstance(r, BaseException)}
        if errors:
            if len(self.clients) == 1:
                raise errors[self.names[0]]
            raise FanOutError(what, errors, len(self.clients)) from next(iter(errors.values()))
        return dict(zip(self.names, results, strict=True))

    # ---- generation ---------------------------------------------------------------------------
    async def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        cache_salt: str | None = None,
        session_id: str | None = None,
    ) -> RequestOutput:
        """Generate on the engine the router picks (the session's engine when it has one)."""
        name = self.router.pick(session_id)
        self.router.acquire(name)
        try:
            return await self.clients[name].generate(
                prompt_token_ids, params, request_id=request_id, cache_salt=cache_salt, session_id=session_id
            )
        finally:
            self.router.release(name)

    # ---- control ------------------------------------------------------------------------------
    async def pause(self, mode: str = "keep") -> None:
        await self._all(f"pause(mode={mode!r})", "pause", mode)

    async def resume(self) -> None:
        await self._all("resume()", "resume")

    async def sleep(self, offload_kv: bool = False) -> None:
        await self._all(f"sleep(offload_kv={offload_kv})", "sleep", offload_kv)

    async def wake_up(self, tags: list[str] | None = None) -> None:
        await self._all(f"wake_up(tags={tags})", "wake_up", tags)

    async def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """True iff every engine's prefix cache is now empty."""
        results = await self._all("reset_prefix_cache()", "reset_prefix_cache", reset_running_requests)
        return all(bool(r) for r in results.values())

    async def begin_weight_update(self) -> None:
        await self._all("begin_weight_update()", "begin_weight_update")

    async def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The same tensors to every engine (each copies them into its own parameters)."""
        tensors = list(named_tensors)  # an iterator would be used up by the first engine
        await self._all(f"load_weights({len(tensors)} tensors)", "load_weights", tensors)

    async def finish_weight_update(self, version: int | None = None) -> int:
        results = await self._all(f"finish_weight_update({version})", "finish_weight_update", version)
        return _common_version(results, "finished the update at different versions")

    async def abort_weight_update(self) -> bool:
        """True iff every engine is back on its pre-update weights."""
        results = await self._all("abort_weight_update()", "abort_weight_update")
        return all(bool(r) for r in results.values())

    async def weight_versions(self) -> dict[str, int]:
        """Each engine's weight version, by name."""
        return {n: int(v) for n, v in (await self._all("weight_version()", "weight_version")).items()}

    async def weight_version(self) -> int:
        """The engines' common weight version; raises InconsistentServersError if they differ."""
        return _common_version(await self.weight_versions(), "are at different weight versions")

    async def engine_stats(self) -> dict[str, dict[str, int]]:
        """Each engine's counters (`EngineStats.as_dict()`), by name."""
        results = await asyncio.gather(*(_stats(c) for c in self.clients.values()))
        return dict(zip(self.names, results, strict=True))

    async def stats(self) -> dict[str, int]:
        """The engines' counters, summed."""
        total: dict[str, int] = {}
        for counters in (await self.engine_stats()).values():
            for key, value in counters.items():
                total[key] = total.get(key, 0) + value
        return total

    async def close(self) -> None:
        await self._all("close()", "close")


def _common_version(versions: dict[str, Any], problem: str) -> int:
    values = {n: int(v) for n, v in versions.items()}
    if len(set(values.values())) != 1:
        raise InconsistentServersError(f"engines {problem}: {values}")
    return next(iter(values.values()))


async def _stats(client: Any) -> dict[str, int]:
    """A client's engine counters: its `stats()` call, or the in-process engine's `stats`."""
    stats = getattr(client, "stats", None)
    if callable(stats):
        return dict(await stats())
    engine = getattr(client, "engine", None)
    counters = getattr(getattr(engine, "engine", engine), "stats", None)
    if counters is None or not hasattr(counters, "as_dict"):
        raise TypeError(f"{type(client).__name__} cannot report engine counters")
    return counters.as_dict()
