"""Weight updates over a broadcast group a client hosts: the client's broadcast calls
(`init_weight_transfer`, `update_weights_broadcast`, `close_weight_transfer`) as a channel in
front of the one group sender (`inflight.weight_sync.group.GroupHost`, rank 0) and the one
engine-side receiver.

The control messages travel as the member clients' operations (`join_weight_group`,
`receive_weight_chunk`, `leave_weight_group`: over a pipe, a Ray call, or HTTP routes); each
chunk's bytes in one broadcast, whatever the number of engines. An engine that fails a chunk before
joining its broadcast leaves the others waiting in it until the group's timeout; the group is then
dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Awaitable, Iterable, Iterator
from typing import Any, Protocol, runtime_checkable

import torch

from inflight.client.base import InferenceClient
from inflight.client.errors import FanOutError
from inflight.client.update import update_all_or_nothing
from inflight.weight_sync.chunking import DEFAULT_CHUNK_BYTES, WeightChunk
from inflight.weight_sync.group import DEFAULT_WEIGHT_GROUP, GroupHost, in_daemon_thread
from inflight.weight_sync.transport import WeightTransport

_BROADCAST_GRACE_S = 10.0  # how long a chunk's broadcast may lag behind the engines' answers


@runtime_checkable
class GroupMemberClient(Protocol):
    """A client whose engine can join a group hosted elsewhere (process, Ray and HTTP clients)."""

    async def join_weight_group(self, request: dict[str, Any]) -> dict[str, Any]: ...
    async def receive_weight_chunk(self, metadata: dict[str, Any]) -> int: ...
    async def leave_weight_group(self) -> bool: ...


async def gather(what: str, calls: dict[str, Awaitable[Any]]) -> dict[str, Any]:
    """THE fan-out: await every call concurrently; raise if any failed (after all have finished):
    the engine's own error when there is one engine, else a FanOutError naming each failing one."""
    names = list(calls)
    results = await asyncio.gather(*calls.values(), return_exceptions=True)
    errors = {n: r for n, r in zip(names, results, strict=True) if isinstance(r, BaseException)}
    if errors:
        if len(names) == 1:
            raise errors[names[0]]
        raise FanOutError(what, errors, len(names)) from next(iter(errors.values()))
    return dict(zip(names, results, strict=True))


class WeightGroup(WeightTransport):
    """One group this process hosts (rank 0) over the engines behind `members` (name -> a client
    with `join_weight_group` / `receive_weight_chunk` / `leave_weight_group`; member i joins at
    rank i + 1). A transport for `update_all_or_nothing`: the lifecycle goes through the client."""

    name = "weight-group"

    def __init__(self, members: dict[str, GroupMemberClient]) -> None:
        super().__init__()
        self.members = dict(members)
        self.sender: GroupHost | None = None

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
        sender = GroupHost(len(self.members) + 1, master_address, master_port, backend=backend, device=device,
                           group_name=group_name, max_chunk_bytes=max_chunk_bytes or DEFAULT_CHUNK_BYTES,
                           dtype=dtype, timeout_s=timeout_s)
        ranks = {name: i + 1 for i, name in enumerate(self.members)}
        cancel = threading.Event()
        formed = in_daemon_thread(sender.connect, cancel)
        joins = {n: asyncio.ensure_future(c.join_weight_group({**sender.init_request(ranks[n]),
                                                               "override_existing": override_existing}))
                 for n, c in self.members.items()}
        try:
            await _first_failure(joins.values(), cancel, sender)
            await gather("init_weight_transfer()", joins)
            await formed
        except BaseException:
            cancel.set()
            sender.close()
            raise
        self.sender = sender
        return {"master_address": master_address, "master_port": sender.port, "world_size": sender.world_size,
                "backend": sender.backend, "group_name": group_name, "ranks": ranks}

    def _sender(self) -> GroupHost:
        if self.sender is None:
            raise RuntimeError("no weight broadcast group: call init_weight_transfer() first")
        return self.sender

    def chunks(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[WeightChunk]:
        return self._sender().chunks(named_tensors)

    async def send_chunk(self, client: InferenceClient, chunk: WeightChunk) -> None:
        """The chunk's metadata to every member, its bytes in one broadcast."""
        sender = self._sender()
        sent = in_daemon_thread(sender.send, chunk)
        what = f"update_weights_broadcast(chunk {chunk.index}, {chunk.nbytes} bytes)"
        try:
            await gather(what, {n: c.receive_weight_chunk(chunk.metadata()) for n, c in self.members.items()})
        except BaseException as err:
            if not await _completed(sent):
                self.sender = None
                sender.close()
                err.add_note("not every engine took part in the chunk's broadcast; the weight group is "
                             "dropped: call init_weight_transfer() again")
            raise
        await sent

    async def leave(self) -> None:
        """Have every member leave, then drop the group (also when leaving failed)."""
        sender, self.sender = self.sender, None
        try:
            await gather(
                "close_weight_transfer()", {n: c.leave_weight_group() for n, c in self.members.items()}
            )
        finally:
            if sender is not None:
                sender.close()


async def _first_failure(joins: Iterable[asyncio.Future], cancel: threading.Event, sender: GroupHost) -> None:
    """Wait for the joins; at the first that fails (a member is gone or refused), stop forming the
    group and drop its rendezvous store, so that the members still joining fail at once instead of
    waiting for the group's timeout for a rank that will never come."""
    pending = set(joins)
    while pending:
        done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        if any(f.cancelled() or f.exception() is not None for f in done):
            cancel.set()
            sender.close()
            return


async def _completed(sent: asyncio.Future) -> bool:
    """Whether a chunk's broadcast still completed (every rank took part: the group is in step)."""
    done, _ = await asyncio.wait({sent}, timeout=_BROADCAST_GRACE_S)
    return bool(done) and sent.exception() is None


class HostsWeightGroup:
    """The InferenceClient's broadcast calls, for a client that hosts the group over the engines
    behind `_group_members()`."""

    _weight_group: WeightGroup | None = None

    def _group_members(self) -> dict[str, GroupMemberClient]:
        """Name -> client (able to join a group hosted here) of each engine, in rank order."""
        raise NotImplementedError(f"{type(self).__name__} cannot join a weight broadcast group")

    async def init_weight_transfer(self, master_address: str = "127.0.0.1", master_port: int = 0,
                                   **options: Any) -> dict[str, Any]:
        """Host a weight broadcast group over every engine (this process rank 0, engine i rank
        i + 1); `options` as in `InferenceClient.init_weight_transfer`. A group formed before is
        left first."""
        members = self._group_members()
        await self._leave_group()
        group = WeightGroup(members)
        info = await group.form(master_address, master_port, **options)
        self._weight_group = group
        return info

    async def update_weights_broadcast(self, named_tensors: Iterable[tuple[str, torch.Tensor]],
                                       version: int | None = None) -> int:
        """begin → each chunk's bytes in one broadcast → finish on every engine, all or nothing:
        on failure the update is aborted (old weights back where the engines kept them) and the
        error re-raised."""
        return await update_all_or_nothing(self, self._group(), named_tensors, version)  # type: ignore[arg-type]

    async def close_weight_transfer(self) -> None:
        """Have every engine leave the group, then drop this side of it."""
        await self._leave_group()

    @property
    def weight_group(self) -> WeightGroup | None:
        """The group this client hosts, as a transport for `update_all_or_nothing` (None before
        `init_weight_transfer` and once a failed broadcast dropped it)."""
        group = self._weight_group
        return group if group is not None and group.sender is not None else None

    async def _leave_group(self) -> None:
        group, self._weight_group = self._weight_group, None
        if group is not None:
            await group.leave()

    async def close(self) -> None:
        """Leave the weight group if any (best effort: an engine that is gone has no group to leave)."""
        with contextlib.suppress(Exception):
            await self.close_weight_transfer()

    def _group(self) -> WeightGroup:
        if self._weight_group is None or self._weight_group.sender is None:
            raise RuntimeError("no weight broadcast group: call init_weight_transfer() first")
        return self._weight_group
