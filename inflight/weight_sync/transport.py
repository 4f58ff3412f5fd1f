"""The transport interface (the sender), and the TCPStore control channel of the cross-process ones.

A transport moves one weight update to the engines: `begin`, `send_chunk` for each chunk, `finish`
(or `abort` after a failure), always through `inflight.client.update.update_all_or_nothing`. The
sync executor decides when (the plan's `send_weights` step), the transport decides how; the
executor alone issues the prefix-cache reset. Before it pauses the engines the executor lets the
transport `stage` the update (the shm transport packs it into shared memory then, so the pause
holds only the engines' copy); the others stage nothing.

Cross-process transports (`shm`, `broadcast`) carry the bytes on their own path and everything else
(the update lifecycle and each chunk's metadata: names, dtypes, shapes, offsets) as small JSON
messages over a control channel on a `torch.distributed.TCPStore` hosted by the sender. On the
engine side the one `Receiver` (`inflight.weight_sync.receiver`) applies each message.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
import time
from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

from inflight.engine import errors as engine_errors
from inflight.weight_sync.chunking import DEFAULT_CHUNK_BYTES, WeightChunk, iter_chunks


class UpdateClient(Protocol):
    """What a transport drives on the engines' client: the update lifecycle of
    `inflight.client.InferenceClient` (weight_sync sits below the client layer, so it names only this)."""

    async def begin_weight_update(self) -> None: ...

    async def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None: ...

    async def finish_weight_update(self, version: int | None = None) -> int: ...

    async def abort_weight_update(self) -> bool: ...


@dataclass
class StagedUpdate:
    """An update a transport prepared before the engines paused (`WeightTransport.stage`): its
    chunks, in order; the transport knows which of them it packed already."""

    chunks: Iterator[WeightChunk]


class TransportError(RuntimeError):
    """A weight transport could not deliver an update (connection, timeout, receiver failure)."""


class WeightTransport:
    """How the `send_weights` step of a sync moves tensors. Subclasses say how a chunk travels
    (`send_chunk`); the lifecycle goes through the client unless they override it too.

    `split_tensors`: chunks may carry pieces of tensors larger than `max_chunk_bytes`.
    """

    name = "base"
    split_tensors = False
    def __init__(self, max_chunk_bytes: int = DEFAULT_CHUNK_BYTES, dtype: torch.dtype | None = None) -> None:
        self.max_chunk_bytes = int(max_chunk_bytes)
        self.dtype = dtype

    async def stage(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> StagedUpdate | Iterable:
        """Prepare the update while the engines still generate; returns what to hand
        `update_all_or_nothing` instead of `named_tensors` (itself: nothing staged)."""
        return named_tensors

    def chunks(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]] | StagedUpdate
    ) -> Iterator[WeightChunk]:
        """The chunks this transport sends for these tensors (lazy), or a staged update's."""
        if isinstance(named_tensors, StagedUpdate):
            return named_tensors.chunks
        return iter_chunks(named_tensors, self.max_chunk_bytes, split=self.split_tensors, dtype=self.dtype)

    async def begin(self, client: UpdateClient) -> None:
        await client.begin_weight_update()

    async def send_chunk(self, client: UpdateClient, chunk: WeightChunk) -> None:
        raise NotImplementedError

    async def finish(self, client: UpdateClient, version: int | None) -> int:
        """Complete the update at `version`; returns the engines' new version."""
        return int(await client.finish_weight_update(version))

    async def abort(self, client: UpdateClient) -> bool:
        """Abandon the update; True when every engine is back on its pre-update weights."""
        return bool(await client.abort_weight_update())

    def close(self) -> None:
        """Release what the transport holds (idempotent)."""

    def __enter__(self) -> WeightTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---- the control channel --------------------------------------------------------------------------
_TIMEOUT = datetime.timedelta(seconds=600)
ALIVE_CHECK_S = 1.0  # how often a sender waiting for an acknowledgement checks that its receivers live
_IDLE = datetime.timedelta(days=7)
_ENGINE_ERRORS = ("WeightUpdateError", "EngineStateError", "InvalidRequestError")


def _start_key(rank: int) -> str:
    """Where the sender says at which message a readmitted receiver starts."""
    return f"start/{rank}"


def _error_class(name: str) -> type[Exception]:
    """The engine's error class of that name (so callers catch the same classes as in process)."""
    return getattr(engine_errors, name) if name in _ENGINE_ERRORS else TransportError


def _timedelta(seconds: float | datetime.timedelta) -> datetime.timedelta:
    return seconds if isinstance(seconds, datetime.timedelta) else datetime.timedelta(seconds=seconds)


@dataclass(frozen=True)
class Posted:
    """A message posted to the receivers, whose acknowledgements are still to be collected."""

    seq: int
    op: str
    targets: list[int]


def checked(replies: list[dict]) -> list[Any]:
    """The results of `replies`, raising the first receiver error (engine errors keep their class)."""
    for r, reply in enumerate(replies, start=1):  # all answered: none stopped
        if not reply.get("ok"):
            cls = _error_class(reply.get("type", ""))
            raise cls(f"weight-sync receiver {r}: {reply.get('error')}")
    return [reply.get("result") for reply in replies]


class ControlChannel:
    """Numbered JSON messages from one sender to `num_receivers` receivers, each acknowledged.

    The sender hosts a TCPStore at host:port (a port of its own: this store is not the trainer's
    rendezvous). Message n to receiver r is the key `msg/r/n`, its acknowledgement `ack/r/n`.
    """

    def __init__(self, host: str, port: int, num_receivers: int, rank: int = 0,
                 timeout: float | datetime.timedelta = _TIMEOUT) -> None:
        if not 0 <= rank <= num_receivers:
            raise ValueError(f"rank {rank} must be 0 (sender) or 1..{num_receivers} (receivers)")
        self.host, self.port, self.rank, self.num_receivers = host, port, rank, num_receivers
        self.timeout = _timedelta(timeout)
        try:
            self.store = dist.TCPStore(host, port, num_receivers + 1, rank == 0, timeout=self.timeout,
                                       wait_for_workers=False)
        except (RuntimeError, OSError) as err:
            role = "host" if rank == 0 else "reach"
            raise TransportError(f"cannot {role} the weight-sync control store at {host}:{port}: "
                                 f"{err}") from err
        self.seq = 0
        self.stopped: set[int] = set()  # receivers found dead (sender side)
        # sender side: the receivers whose process has exited (set by whoever started them); a
        # wait for an acknowledgement checks it every ALIVE_CHECK_S instead of waiting its whole
        # timeout for a process that is gone
        self.dead_receivers: Callable[[], Collection[int]] | None = None
        # receiver side: a receiver that replaces a dead one starts at the message the sender
        # posts next (`readmit`), not at the first
        self.readmitted = False
        if rank > 0 and self.store.check([_start_key(rank)]):
            self.seq, self.readmitted = int(self.store.get(_start_key(rank))), True

    def readmit(self, rank: int) -> None:
        """Sender: receiver `rank`'s process was replaced (call before starting the new one): the
        new receiver is sent messages again, from the next one on."""
        self.stopped.discard(rank)
        self.store.set(_start_key(rank), str(self.seq))

    # sender side
    def send(self, message: dict, timeout: float | datetime.timedelta | None = None,
             during: Callable[[], None] | None = None) -> list[dict]:
        """Post `message` to every receiver, run `during()` (e.g. a collective the receivers join
        on reading the message), then wait for every acknowledgement; returns the replies."""
        posted = self.post(message)
        if during is not None:
            during()
        return self.collect(posted, timeout)

    def post(self, message: dict) -> Posted:
        """Post `message` to every receiver without waiting; `collect` its replies later (messages
        are applied in order, so a sender may post the next before the last is answered)."""
        if self.stopped and message["op"] != "close":
            raise TransportError(f"weight-sync receivers {sorted(self.stopped)} have stopped")
        targets = [r for r in range(1, self.num_receivers + 1) if r not in self.stopped]
        seq, self.seq = self.seq, self.seq + 1
        body = json.dumps({**message, "seq": seq})
        for r in targets:
            self.store.set(f"msg/{r}/{seq}", body)
        return Posted(seq, message["op"], targets)

    def collect(self, posted: Posted, timeout: float | datetime.timedelta | None = None) -> list[dict]:
        """Wait for every acknowledgement of a posted message; returns the replies."""
        wait = self.timeout if timeout is None else _timedelta(timeout)
        replies = []
        for r in posted.targets:
            try:
                self._wait_ack(r, posted.seq, wait, posted.op)
                replies.append(json.loads(self.store.get(f"ack/{r}/{posted.seq}")))
            except (RuntimeError, OSError) as err:  # DistStoreError (timeout), connection lost
                raise TransportError(f"weight-sync receiver {r} did not answer {posted.op!r} within "
                                     f"{wait.total_seconds():.0f}s: {err}") from err
            self.store.delete_key(f"ack/{r}/{posted.seq}")
            self.store.delete_key(f"msg/{r}/{posted.seq}")
        return replies

    def _wait_ack(self, r: int, seq: int, wait: datetime.timedelta, op: str) -> None:
        """Wait for receiver r's acknowledgement of message `seq`, in slices of ALIVE_CHECK_S,
        raising TransportError at once when `dead_receivers` names a receiver whose process is gone."""
        deadline = time.monotonic() + wait.total_seconds()
        while True:
            left = deadline - time.monotonic()
            step = min(ALIVE_CHECK_S, left) if self.dead_receivers is not None else left
            try:
                self.store.wait([f"ack/{r}/{seq}"], datetime.timedelta(seconds=max(step, 0.001)))
                return
            except RuntimeError:
                if time.monotonic() >= deadline:
                    raise
                dead = set(self.dead_receivers()) if self.dead_receivers is not None else set()
                if dead:  # a dead receiver never answers: the exchange cannot complete
                    self.stopped |= dead
                    names = ", ".join(map(str, sorted(dead)))
                    raise TransportError(f"weight-sync receiver {names}'s process died (waiting for receiver "
                                         f"{r}'s answer to {op!r})") from None

    def send_checked(self, message: dict, during: Callable[[], None] | None = None) -> list[Any]:
        """`send`, raising the first receiver error (engine errors keep their class)."""
        return checked(self.send(message, during=during))

    # receiver side
    def recv(self) -> dict:
        """Block until the next message for this receiver arrives."""
        key = f"msg/{self.rank}/{self.seq}"
        self.store.wait([key], _IDLE)
        return json.loads(self.store.get(key))

    def ack(self, reply: dict) -> None:
        self.store.set(f"ack/{self.rank}/{self.seq}", json.dumps(reply))
        self.seq += 1


class ChannelTransport(WeightTransport):
    """Sender side of a cross-process transport: lifecycle and metadata over a `ControlChannel`.

    The client is not used for the update itself (the receivers drive their engines), so the
    client may be any UpdateClient (or None) for these calls.
    """

    channel: ControlChannel

    def _send_bytes(self, chunk: WeightChunk, message: dict) -> list[Any]:
        raise NotImplementedError

    async def begin(self, client: UpdateClient | None) -> None:
        await asyncio.to_thread(self.channel.send_checked, {"op": "begin"})

    async def send_chunk(self, client: UpdateClient | None, chunk: WeightChunk) -> None:
        await asyncio.to_thread(self._send_bytes, chunk, {"op": "chunk", "chunk": chunk.metadata()})

    async def finish(self, client: UpdateClient | None, version: int) -> int:
        results = await asyncio.to_thread(self.channel.send_checked, {"op": "finish", "version": version})
        return int(results[0])

    async def abort(self, client: UpdateClient | None) -> bool:
        results = await asyncio.to_thread(self.channel.send_checked, {"op": "abort"})
        return all(results)

    def readmit(self, ranks: Collection[int]) -> None:
        """The receivers at `ranks` are being replaced (their processes died): call before starting
        the new ones; they get messages from the next one on."""
        for rank in ranks:
            self.channel.readmit(rank)

    def close_receivers(self, timeout: float = 10.0) -> None:
        """Tell every receiver to return from `serve` (best effort)."""
        with contextlib.suppress(TransportError):
            self.channel.send({"op": "close"}, timeout=timeout)
