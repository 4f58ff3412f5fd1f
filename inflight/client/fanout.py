"""FanOutClient: one InferenceClient over several engines' clients (local, process, Ray or HTTP),
the one fan-out (`RemoteClient` is a FanOutClient over one HTTP client per server).

Generation goes to one engine chosen by the `Router` (least outstanding requests; a session stays
on its engine so a multi-turn trajectory finds its prefix in that engine's cache); a request that
provably never reached its engine (`request_sent=False`: a refused connection) goes to another.
Every other operation goes to every engine at once and waits for all of them before it returns
or raises (`inflight.client.group.gather`): a call that failed on any engine raises (`FanOutError`,
naming each failing engine; the engine's own error when there is one engine), and the engines
where it succeeded have completed it, so the caller (the sync executor) can bring all of them
back to one state with `abort_weight_update` / `resume`. Each operation's `combine` makes one
answer of theirs (`inflight.client.base.OPS`).

Weight updates over a broadcast group (`init_weight_transfer`, ...): this process hosts ONE group
over every engine, so each chunk's bytes travel in one broadcast whatever the number of engines.
That needs member clients able to join a group hosted elsewhere (process, Ray and HTTP engine
clients); for others it raises NotImplementedError naming the alternatives.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from inflight.client.base import OPS, InferenceClient
from inflight.client.group import GroupMemberClient, HostsWeightGroup, gather
from inflight.client.router import Router
from inflight.engine.multimodal import MultimodalInput
from inflight.engine.request import RequestOutput, SamplingParams


def _describe(op: str, args: tuple) -> str:
    """The call as errors name it (a payload by its size)."""
    shown = [f"{len(a)} tensors" if isinstance(a, list) else f"{len(a)} bytes" if isinstance(a, bytes)
             else repr(a) for a in args]
    return f"{op}({', '.join(shown)})"


class FanOutClient(HostsWeightGroup, InferenceClient):
    """InferenceClient over `clients` (any InferenceClients); `names` label them in errors.
    `retries` / `backoff_s`: how often a generation request never sent is tried elsewhere."""

    def __init__(self, clients: Sequence[InferenceClient], names: Sequence[str] | None = None,
                 router: Router | None = None, retries: int = 3, backoff_s: float = 0.1) -> None:
        if not clients:
            raise ValueError(f"{type(self).__name__} needs at least one client")
        self.names = list(names) if names is not None else [f"engine-{i}" for i in range(len(clients))]
        if len(self.names) != len(clients) or len(set(self.names)) != len(self.names):
            raise ValueError(f"need one distinct name per client, got {self.names}")
        self.clients: dict[str, InferenceClient] = dict(zip(self.names, clients, strict=True))
        self.router = router or Router(self.names)
        self.retries, self.backoff_s = retries, backoff_s

    def __len__(self) -> int:
        return len(self.clients)

    async def _each(self, op: str, *args: Any) -> dict[str, Any]:
        """`op` on every engine concurrently, by name; raises if it failed on any."""
        if op == "load_weights":
            args = (list(args[0]),)  # the same tensors to every engine: an iterator would be used up
        return await gather(_describe(op, args), {n: getattr(c, op)(*args) for n, c in self.clients.items()})

    async def _call(self, op: str, *args: Any) -> Any:
        return OPS[op].combine(await self._each(op, *args))

    async def weight_versions(self) -> dict[str, int]:
        """Each engine's weight version, by name."""
        return {n: int(v) for n, v in (await self._each("weight_version")).items()}

    async def engine_stats(self) -> dict[str, dict[str, int]]:
        """Each engine's counters (`EngineStats.as_dict()`), by name."""
        return await self._each("stats")

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
        """Generate on the engine the router picks (the session's engine when it has one); fails
        over only when the request was not sent."""
        failed: set[str] = set()
        last: BaseException | None = None
        for attempt in range(self.retries + 1):
            name = self.router.pick(session_id, avoid=failed)
            self.router.acquire(name)
            try:
                output = await self.clients[name].generate(prompt_token_ids, params, request_id=request_id,
                                                           cache_salt=cache_salt, session_id=session_id,
                                                           multimodal=multimodal)
            except ConnectionError as err:
                if getattr(err, "request_sent", True):
                    raise
                last = err
                self.router.mark_down(name)
                failed.add(name)
                if len(failed) >= len(self.clients):  # every engine refused: wait, then try them again
                    failed.clear()
                    await asyncio.sleep(self.backoff_s * 2**attempt)
                continue
            finally:
                self.router.release(name)
            self.router.mark_up(name)
            return output
        assert last is not None
        raise last

    def _group_members(self) -> dict[str, GroupMemberClient]:
        lacking = [f"{n} ({type(c).__name__})" for n, c in self.clients.items()
                   if not isinstance(c, GroupMemberClient)]
        if lacking:
            raise NotImplementedError(
                "FanOutClient forms one weight broadcast group only over clients that can join a group "
                f"hosted elsewhere (process, Ray and HTTP engine clients); {', '.join(lacking)} cannot. Use "
                "load_weights (the same tensors to every engine), a RemoteClient over all the servers' URLs "
                "(one broadcast group spanning them), or the `broadcast` weight-sync transport "
                "(generator.inference_engine.weight_sync_backend=broadcast)"
            )
        return self.clients  # type: ignore[return-value]  # checked above

    async def close(self) -> None:
        await super().close()  # the weight group first
        await self._each("close")
