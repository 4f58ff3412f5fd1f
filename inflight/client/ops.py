"""The InferenceClient protocol as operations: `OpClient` writes every call once as `_call(op, *args)`,
and a client is only how an operation travels (in process, a pipe, a Ray actor call, HTTP, or to
every engine at once). `apply_op` runs an operation on an AsyncEngine: the engine side of every
client but HTTP (whose engine side is the server's routes).

`COMBINE` says how the engines' answers to one operation become one answer (the fan-out's rule).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from inflight.client.errors import InconsistentServersError
from inflight.client.group import HostsWeightGroup
from inflight.engine.async_engine import AsyncEngine
from inflight.engine.request import RequestOutput, SamplingParams


def _common(problem: str) -> Callable[[dict[str, Any]], int]:
    def combine(answers: dict[str, Any]) -> int:
        values = {n: int(v) for n, v in answers.items()}
        if len(set(values.values())) != 1:
            raise InconsistentServersError(f"engines {problem}: {values}")
        return next(iter(values.values()))

    return combine


def _summed(answers: dict[str, Any]) -> dict[str, int]:
    total: dict[str, int] = {}
    for counters in answers.values():
        for key, value in counters.items():
            total[key] = total.get(key, 0) + value
    return total


def _every(answers: dict[str, Any]) -> bool:
    return all(bool(a) for a in answers.values())


COMBINE: dict[str, Callable[[dict[str, Any]], Any]] = {
    "pause": lambda _: None,
    "resume": lambda _: None,
    "sleep": lambda _: None,
    "wake_up": lambda _: None,
    "reset_prefix_cache": _every,  # True iff every engine's cache is now empty
    "begin_weight_update": lambda _: None,
    "load_weights": lambda _: None,
    "finish_weight_update": _common("finished the update at different versions"),
    "abort_weight_update": _every,  # True iff every engine is back on its pre-update weights
    "weight_version": _common("are at different weight versions"),
    "stats": _summed,
}
"""The operations that go to every engine, and how their answers combine (generation goes to one)."""


class OpClient(HostsWeightGroup):
    """The InferenceClient protocol over one coroutine, `_call(op, *args)`."""

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
    ) -> RequestOutput:
        return await self._call("generate", list(prompt_token_ids), params, request_id, cache_salt)

    async def pause(self, mode: str = "keep") -> None:
        await self._call("pause", mode)

    async def resume(self) -> None:
        await self._call("resume")

    async def sleep(self, offload_kv: bool = False) -> None:
        await self._call("sleep", offload_kv)

    async def wake_up(self, tags: list[str] | None = None) -> None:
        await self._call("wake_up", tags)

    async def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        return await self._call("reset_prefix_cache", reset_running_requests)

    async def begin_weight_update(self) -> None:
        await self._call("begin_weight_update")

    async def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        await self._call("load_weights", [(n, t.detach().cpu()) for n, t in named_tensors])

    async def finish_weight_update(self, version: int | None = None) -> int:
        return await self._call("finish_weight_update", version)

    async def abort_weight_update(self) -> bool:
        return await self._call("abort_weight_update")

    async def weight_version(self) -> int:
        return await self._call("weight_version")

    async def stats(self) -> dict[str, int]:
        """The engine's counters (`EngineStats.as_dict()`)."""
        return await self._call("stats")

    async def close(self) -> None:
        """Leave the weight group if any (best effort); whoever started the engine stops it."""
        try:
            await self.close_weight_transfer()
        except Exception:  # an engine that is gone has no group to leave
            pass


class JoiningClient(OpClient):
    """An OpClient whose engine can join a weight group hosted here (process and Ray clients)."""

    def _group_members(self) -> dict[str, Any]:
        return {"engine": self}

    async def join_weight_group(self, request: dict[str, Any]) -> dict[str, Any]:
        """Have the engine join a weight group hosted elsewhere (`GroupHost.init_request`)."""
        return await self._call("join_weight_group", request)

    async def receive_weight_chunk(self, metadata: dict[str, Any]) -> int:
        """Have the engine join one chunk's broadcast and load what it completes."""
        return await self._call("receive_weight_chunk", metadata)

    async def leave_weight_group(self) -> bool:
        return await self._call("leave_weight_group")


GROUP_OPS = {"join_weight_group": "join", "receive_weight_chunk": "receive", "leave_weight_group": "leave"}
"""Operations on the engine's membership of a weight broadcast group its client hosts."""


async def apply_op(engine: AsyncEngine, op: str, *args: Any) -> Any:
    """Run one operation (`COMBINE`'s, `generate`, or a `GROUP_OPS` one) on an AsyncEngine."""
    from inflight.weight_sync.receiver import engine_receiver  # on use: torch.distributed

    if op == "stats":
        return engine.engine.stats.as_dict()
    if op == "weight_version":
        return engine.weight_version
    if op in GROUP_OPS:
        return await getattr(engine_receiver(engine), GROUP_OPS[op])(*args)
    if op != "generate" and op not in COMBINE:
        raise ValueError(f"unknown engine operation {op!r}")
    if op in ("begin_weight_update", "abort_weight_update"):
        engine_receiver(engine).clear_pieces()
    result = await getattr(engine, op)(*args)
    return None if op == "pause" else result
