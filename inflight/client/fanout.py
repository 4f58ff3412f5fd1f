"""FanOutClient: one InferenceClient over several engines' clients (local, process, Ray or HTTP).

Generation goes to one engine chosen by the `Router` (least outstanding requests; a session stays
on its engine so a multi-turn trajectory finds its prefix in that engine's cache). Every control
call (pause, sleep, the weight-update calls, reset, resume) goes to every engine at once and
waits for all of them before it returns or raises: a call that failed on any engine raises
(`FanOutError`, naming each failing engine; the engine's own error when there is one engine), and
the engines where it succeeded have completed it, so the caller (the sync executor) can bring all
of them back to one state with `abort_weight_update` / `resume`.

Weight updates over a broadcast group (`init_weight_transfer`, ...): this process hosts ONE group
over every engine (`WeightGroupHost`), so each chunk's bytes travel in one broadcast whatever the
number of engines. That needs member clients able to join a group hosted elsewhere (the process
and Ray engine clients); for others it raises NotImplementedError naming the alternatives.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from inflight.client.base import update_all_or_nothing
from inflight.client.errors import FanOutError, InconsistentServersError
from inflight.client.router import Router
from inflight.client.wire import DEFAULT_WEIGHT_GROUP
from inflight.engine.request import RequestOutput, SamplingParams

if TYPE_CHECKING:  # imported on use: torch.distributed and the weight-sync package
    from inflight.client.broadcast import WeightBroadcaster

JOIN_METHODS = ("join_weight_group", "receive_weight_chunk", "leave_weight_group")
"""What a member client needs for its engine to be a rank of a group hosted elsewhere."""
_BROADCAST_GRACE_S = 10.0  # how long a chunk's broadcast may lag behind the engines' answers


class HostsWeightGroup:
    """The InferenceClient calls for weight updates over a broadcast group, for a client that hosts
    the group (rank 0) over the engines behind `_group_members()` (a `WeightGroupHost`)."""

    _weight_group: WeightGroupHost | None = None

    def _group_members(self) -> dict[str, Any]:
        """Name -> client (with `JOIN_METHODS`) of each engine to join, in rank order."""
        raise NotImplementedError

    async def init_weight_transfer(
        self, master_address: str = "127.0.0.1", master_port: int = 0, **options: Any
    ) -> dict[str, Any]:
        """Host a weight broadcast group over every engine (this process rank 0, engine i rank
        i + 1); `options` as in `InferenceClient.init_weight_transfer`. A group formed before is
        left first."""
        members = self._group_members()
        await self.close_weight_transfer()
        host = WeightGroupHost(members)
        info = await host.form(master_address, master_port, **options)
        self._weight_group = host
        return info

    async def load_weights_broadcast(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """`load_weights` with each chunk's bytes in one broadcast (between begin and finish)."""
        await self._group().load(named_tensors)

    async def update_weights_broadcast(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int | None = None
    ) -> int:
        """begin → load_weights_broadcast → finish on every engine, all or nothing: on failure the
        update is aborted (old weights back where the engines kept them) and the error re-raised."""
        self._group()
        return await update_all_or_nothing(self, lambda: self.load_weights_broadcast(named_tensors), version)

    async def close_weight_transfer(self) -> None:
        """Have every engine leave the group, then drop this side of it."""
        host, self._weight_group = self._weight_group, None
        if host is not None:
            await host.close()

    def _group(self) -> WeightGroupHost:
        if self._weight_group is None or self._weight_group.sender is None:
            raise RuntimeError("no weight broadcast group: call init_weight_transfer() first")
        return self._weight_group


class FanOutClient(HostsWeightGroup):
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
        return await _gather(what, {n: getattr(c, op)(*args, **kwargs) for n, c in self.clients.items()})

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

    # ---- weight updates over one broadcast group ----------------------------------------------------
    def _group_members(self) -> dict[str, Any]:
        lacking = [
            f"{n} ({type(c).__name__})"
            for n, c in self.clients.items()
            if not all(callable(getattr(c, m, None)) for m in JOIN_METHODS)
        ]
        if lacking:
            raise NotImplementedError(
                "FanOutClient forms one weight broadcast group only over clients that can join a group "
                f"hosted elsewhere (process and Ray engine clients); {', '.join(lacking)} cannot. Use "
                "load_weights (the same tensors to every engine), a RemoteClient over all the servers' URLs "
                "(one broadcast group spanning them), or the `broadcast` weight-sync transport "
                "(generator.inference_engine.weight_sync_backend=broadcast)"
            )
        return self.clients

    async def close(self) -> None:
        try:
            await self.close_weight_transfer()
        except Exception:  # best effort: an engine that is gone has no group to leave
            pass
        await self._all("close()", "close")


class WeightGroupHost:
    """One weight broadcast group this process hosts (rank 0) over the engines behind `members`
    (name -> a client with `JOIN_METHODS`; member i joins at rank i + 1). Used by FanOutClient and
    by the process and Ray engine clients (one member).

    As with the HTTP servers, an engine that fails a chunk before joining its broadcast leaves the
    others waiting in it until the group's timeout; the group is then dropped.
    """

    def __init__(self, members: dict[str, Any]) -> None:
        self.members = dict(members)
        self.sender: WeightBroadcaster | None = None

    async def form(
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
        """Host the rendezvous at master_address:master_port (0: a free port) and have every member
        join; returns once all have (address, port, world size, backend, each member's rank)."""
        from inflight.client.broadcast import WeightBroadcaster, in_daemon_thread
        from inflight.weight_sync.chunking import DEFAULT_CHUNK_BYTES

        sender = WeightBroadcaster(
            len(self.members) + 1, master_address, master_port, backend=backend, device=device,
            group_name=group_name, max_chunk_bytes=max_chunk_bytes or DEFAULT_CHUNK_BYTES, dtype=dtype,
            timeout_s=timeout_s,
        )  # fmt: skip
        ranks = {name: i + 1 for i, name in enumerate(self.members)}
        cancel = threading.Event()
        formed = in_daemon_thread(sender.connect, cancel)
        joins = {
            n: c.join_weight_group({**sender.init_request(ranks[n]), "override_existing": override_existing})
            for n, c in self.members.items()
        }
        try:
            await _gather("init_weight_transfer()", joins)
            await formed
        except BaseException:
            cancel.set()
            sender.close()
            raise
        self.sender = sender
        return {
            "master_address": master_address,
            "master_port": sender.port,
            "world_size": sender.world_size,
            "backend": sender.backend,
            "group_name": group_name,
            "ranks": ranks,
        }

    async def load(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Each chunk: its metadata to every member, its bytes in one broadcast."""
        from inflight.client.broadcast import in_daemon_thread

        sender = self.sender
        if sender is None:
            raise RuntimeError("no weight broadcast group: call init_weight_transfer() first")
        for chunk in sender.chunks(named_tensors):
            sent = in_daemon_thread(sender.send, chunk)
            what = f"load_weights_broadcast(chunk {chunk.index}, {chunk.nbytes} bytes)"
            try:
                await _gather(
                    what, {n: c.receive_weight_chunk(chunk.metadata()) for n, c in self.members.items()}
                )
            except BaseException as err:
                if not await _completed(sent):
                    self.sender = None
                    sender.close()
                    err.add_note(
                        "not every engine took part in the chunk's broadcast; the weight group is "
                        "dropped: call init_weight_transfer() again"
                    )
                raise
            await sent

    async def close(self) -> None:
        """Have every member leave, then drop the group (also when leaving failed)."""
        sender, self.sender = self.sender, None
        try:
            await _gather(
                "close_weight_transfer()", {n: c.leave_weight_group() for n, c in self.members.items()}
            )
        finally:
            if sender is not None:
                sender.close()


async def _gather(what: str, calls: dict[str, Awaitable[Any]]) -> dict[str, Any]:
    """Await every call concurrently; raise if any failed (after all have finished): the engine's
    own error when there is one engine, else a FanOutError naming each failing one."""
    names = list(calls)
    results = await asyncio.gather(*calls.values(), return_exceptions=True)
    errors = {n: r for n, r in zip(names, results, strict=True) if isinstance(r, BaseException)}
    if errors:
        if len(names) == 1:
            raise errors[names[0]]
        raise FanOutError(what, errors, len(names)) from next(iter(errors.values()))
    return dict(zip(names, results, strict=True))


async def _completed(sent: asyncio.Future) -> bool:
    """Whether a chunk's broadcast still completed (every rank took part: the group is in step)."""
    done, _ = await asyncio.wait({sent}, timeout=_BROADCAST_GRACE_S)
    return bool(done) and sent.exception() is None


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
