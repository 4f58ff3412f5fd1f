"""A weight broadcast group: rank 0 (`GroupHost`, the sender) and ranks 1..N (`GroupMember`).

Rank 0 hosts a rendezvous store at master address:port (or uses one it has, e.g. the control
channel's) and posts the group's world size, backend and chunk capacity there; a member checks its
request against them before it joins, so a wrong world size or backend fails at once instead of
leaving everyone waiting for a rank that never comes. Each chunk is packed into one flat buffer
allocated once per side and moved by a single broadcast from rank 0.

No wait on the dead: a member announces itself and enters the group's rendezvous (which nothing
can interrupt) only once rank 0 says `go` (every member announced itself); rank 0 says `cancelled`
when it stops waiting (a member failed to join), and those waiting fail at once. A broadcast that
fails on rank 0 (a member died) destroys rank 0's side of the group, which is what makes a live
member waiting for data that never came fail too, instead of waiting for the group's timeout.

The group is a `ProcessGroupGloo` (CPU) or `ProcessGroupNCCL` (CUDA) object over the store, outside
torch.distributed's registry, so it never clashes with the trainer's default group (FSDP's) or the
engines' own, and needs no participation from other ranks.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import gc
import json
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist

# relative, and nothing of inflight but chunking.py: the vLLM backend loads these two files by path into
# vLLM's interpreter, which lacks this package (inflight/backends/vllm/shared.py)
from .chunking import DEFAULT_CHUNK_BYTES, WeightChunk, iter_chunks, pack_chunk

DEFAULT_WEIGHT_GROUP = "inflight-weights"  # the group's name unless told otherwise


class WeightGroupError(RuntimeError):
    """Joining a weight group failed, or a broadcast in it did. `status` and `code` say which, as
    the server answers it (400 a request that does not match the group, 409 a group in place or
    missing, 502 an unreachable master or a failed broadcast, 504 a group that did not form)."""

    def __init__(self, message: str, status: int = 502, code: str = "weight_transfer_failed",
                 param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.param = status, code, param


def default_backend(device: torch.device | str) -> str:
    """`nccl` for CUDA buffers, `gloo` otherwise."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def make_group(store: dist.Store, rank: int, world_size: int, backend: str,
               timeout: datetime.timedelta) -> dist.ProcessGroup:
    """A process group object over `store`, outside torch.distributed's group registry (blocks
    until all `world_size` ranks have joined)."""
    prefixed = dist.PrefixStore("inflight/weight-sync/group", store)
    if backend == "gloo":
        return dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
    if backend == "nccl":  # untested here (no GPU): the documented CUDA path
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, rank, world_size, options)
    raise ValueError(f"weight-sync backend {backend!r} is not one of gloo, nccl")


def broadcast_from_root(group: dist.ProcessGroup, tensor: torch.Tensor) -> None:
    """Broadcast `tensor` from rank 0 of `group` (blocking: sender and receivers alike)."""
    options = dist.BroadcastOptions()
    options.rootRank = 0
    options.rootTensor = 0
    group.broadcast([tensor], options).wait()


def info_key(group_name: str) -> str:
    """The store key where rank 0 posts the group's world size, backend and chunk capacity."""
    return f"{group_name}/info"


def joining_key(group_name: str, rank: int) -> str:
    """The store key a member sets once it has checked the group and is about to join it."""
    return f"{group_name}/joining/{rank}"


def start_key(group_name: str, outcome: str) -> str:
    """The store key rank 0 sets once every member announced itself (`go`: all enter the group's
    rendezvous) or when it stopped forming the group (`cancelled`: a member failed to join)."""
    return f"{group_name}/{outcome}"


def group_store(store: dist.Store, group_name: str) -> dist.PrefixStore:
    """The part of the rendezvous store that the group named `group_name` forms over."""
    return dist.PrefixStore(f"{group_name}/", store)


def in_daemon_thread(fn: Callable[..., Any], *args: Any) -> asyncio.Future:
    """Run a blocking call in a daemon thread; the returned future holds its result.

    Not `asyncio.to_thread`: a collective whose peers never join blocks until the group's timeout,
    and such a thread must neither hold up the event loop's shutdown nor the interpreter's exit.
    """
    loop = asyncio.get_running_loop()
    future: asyncio.Future = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if not future.done():
            future.set_result(result) if error is None else future.set_exception(error)

    def run() -> None:
        try:
            outcome: tuple[Any, BaseException | None] = (fn(*args), None)
        except BaseException as err:  # handed to the awaiting coroutine
            outcome = (None, err)
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is waiting any more
            loop.call_soon_threadsafe(settle, *outcome)

    threading.Thread(target=run, daemon=True, name=f"weight-broadcast-{fn.__name__}").start()
    future.add_done_callback(lambda f: f.cancelled() or f.exception())  # never "never retrieved"
    return future


class GroupHost:
    """Rank 0: hosts the rendezvous store (or uses `store`), sends each chunk's bytes.

    `master_port=0` picks a free port (see `.port`). The members join at ranks 1..world_size-1
    (`init_request(rank)` is what they need); `connect()` blocks until all have joined. Chunks hold
    at most `max_chunk_bytes` (larger tensors travel in pieces).
    """

    def __init__(self, world_size: int, master_address: str = "127.0.0.1", master_port: int = 0, *,
                 backend: str | None = None, device: str | torch.device = "cpu",
                 group_name: str = DEFAULT_WEIGHT_GROUP, max_chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 dtype: torch.dtype | None = None, timeout_s: float = 600.0,
                 store: dist.TCPStore | None = None) -> None:
        if world_size < 2:
            raise ValueError(
                f"world_size={world_size}: a broadcast group needs rank 0 and at least one member"
            )
        self.world_size, self.master_address, self.group_name = world_size, master_address, group_name
        self.device = torch.device(device)
        self.backend = backend or default_backend(self.device)
        self.max_chunk_bytes, self.dtype, self.timeout_s = int(max_chunk_bytes), dtype, timeout_s
        self.store: dist.TCPStore | None = store or dist.TCPStore(
            master_address, master_port, world_size, True, timeout=datetime.timedelta(seconds=timeout_s),
            wait_for_workers=False)  # fmt: skip
        self.port = self.store.port
        info = {"world_size": world_size, "backend": self.backend, "max_chunk_bytes": self.max_chunk_bytes}
        self.store.set(info_key(group_name), json.dumps(info))
        self.buffer = torch.empty(self.max_chunk_bytes, dtype=torch.uint8, device=self.device)
        self.group: dist.ProcessGroup | None = None

    def init_request(self, rank_offset: int) -> dict[str, Any]:
        """What makes a member join this group at rank `rank_offset` (the server's init body)."""
        return {"master_address": self.master_address, "master_port": self.port, "rank_offset": rank_offset,
                "world_size": self.world_size, "group_name": self.group_name, "backend": self.backend,
                "timeout_s": self.timeout_s}

    def connect(self, cancel: threading.Event | None = None) -> None:
        """Form the group (blocks until every member has joined, or raises after the timeout).

        Rank 0 enters the group only once every member has announced that it is joining, so that
        `cancel` (set when a member refused) can still stop the wait: the group's own rendezvous
        cannot be interrupted.
        """
        store = self.store  # close() may drop it while this runs in a thread
        if store is None:
            raise RuntimeError("this weight group is closed")
        if self.group is not None:
            return
        keys = [joining_key(self.group_name, rank) for rank in range(1, self.world_size)]
        deadline = time.monotonic() + self.timeout_s
        cancel = cancel or threading.Event()
        while not store.check(keys):
            if cancel.wait(0.01):
                store.set(start_key(self.group_name, "cancelled"), "1")  # the members waiting for `go` stop
                raise RuntimeError("forming the weight broadcast group was cancelled")
            if time.monotonic() > deadline:
                store.set(start_key(self.group_name, "cancelled"), "1")
                raise TimeoutError(f"not every member joined the weight group within {self.timeout_s:g}s")
        store.set(start_key(self.group_name, "go"), "1")
        timeout = datetime.timedelta(seconds=self.timeout_s)
        self.group = make_group(
            group_store(store, self.group_name), 0, self.world_size, self.backend, timeout
        )

    def chunks(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[WeightChunk]:
        """The chunks to send for these tensors (lazy, in order)."""
        return iter_chunks(named_tensors, self.max_chunk_bytes, split=True, dtype=self.dtype)

    def send(self, chunk: WeightChunk) -> None:
        """Broadcast the chunk's bytes (blocks until every member has received them). A failed
        broadcast (a member died) drops the group: see `_drop_failed`."""
        group = self.group
        if group is None:
            raise RuntimeError("the weight broadcast group is not formed; call connect() first")
        data = self.buffer[: pack_chunk(chunk, self.buffer)]
        try:
            broadcast_from_root(group, data)
            return
        except RuntimeError as err:
            message = str(err)
        del group
        self._drop_failed()
        raise WeightGroupError(
            f"the weight broadcast failed (a member is gone?); the group is dropped: {message}"
        )

    def _drop_failed(self) -> None:
        """Destroy this side of a group whose broadcast failed. A live member waiting for data that
        rank 0 never sent (gloo sends to one member after another; the broadcast stopped at the dead
        one) would otherwise wait for the group's timeout: neither `abort()` nor `shutdown()` of a
        gloo group closes its connections, only its destruction does. Hence no reference to it may
        survive, not even in a traceback (the caller raises a fresh error)."""
        self.group = None
        gc.collect()

    def close(self) -> None:
        """Drop the group and the store (idempotent; the members drop theirs when told to leave)."""
        self.group = None
        self.store = None


PROBE_S = 3.0  # how long a member tries to reach the host's port before it says nobody listens


def _probe(address: str, port: int, seconds: float, where: str) -> None:
    """Fail in seconds, not the group's whole timeout, when nothing listens at address:port: the
    host opens its store before it asks anyone to join, so a refused connection means no host.
    (TCPStore's own client retries a refused connect until its timeout, 600 s by default.)"""
    deadline = time.monotonic() + seconds
    while True:
        try:
            with socket.create_connection((address, port), timeout=max(0.1, deadline - time.monotonic())):
                return
        except OSError as err:
            if time.monotonic() >= deadline:
                raise WeightGroupError(
                    f"cannot reach the weight-transfer master at {where}: nothing accepts "
                    f"connections there ({err})",
                    502,
                    "weight_transfer_unreachable",
                ) from err
            time.sleep(0.1)


class GroupMember:
    """Rank `rank` of a group, with its receive buffer; `join` builds one (blocking)."""

    def __init__(self, group: dist.ProcessGroup, rank: int, world_size: int, backend: str, group_name: str,
                 buffer: torch.Tensor) -> None:
        self.group, self.rank, self.world_size = group, rank, world_size
        self.backend, self.group_name, self.buffer = backend, group_name, buffer

    @classmethod
    def join(
        cls, request: dict[str, Any], device: torch.device, store: dist.Store | None = None
    ) -> GroupMember:
        """Reach the host's store (`store`, or a connection to master_address:master_port), check
        `request` (`GroupHost.init_request`) against what rank 0 posted, and join."""
        name, rank, size = request["group_name"], request["rank_offset"], request["world_size"]
        seconds = request.get("timeout_s", 600.0)
        timeout = datetime.timedelta(seconds=seconds)
        where = f"{request['master_address']}:{request['master_port']}"
        if store is None:
            _probe(request["master_address"], request["master_port"], min(seconds, PROBE_S), where)
        try:
            store = store or dist.TCPStore(request["master_address"], request["master_port"], size, False,
                                           timeout=timeout)
        except (RuntimeError, OSError) as err:
            raise WeightGroupError(f"cannot reach the weight-transfer master at {where} within {seconds:g}s: "
                                   f"{err}", 502, "weight_transfer_unreachable") from err
        try:
            store.wait([info_key(name)], timeout)
            info = json.loads(store.get(info_key(name)))
        except (RuntimeError, ValueError) as err:
            raise WeightGroupError(
                f"the master at {where} has no weight group {name!r} (waited {seconds:g}s): {err}",
                504,
                "weight_transfer_timeout",
            ) from err
        backend = _check(request, info, device, where)
        store.set(joining_key(name, rank), "1")
        _await_start(store, name, seconds, where)
        try:
            group = make_group(group_store(store, name), rank, size, backend, timeout)
        except RuntimeError as err:
            raise WeightGroupError(f"the weight group {name!r} did not form within {seconds:g}s (are all "
                                   f"{size} ranks joining?): {err}", 504, "weight_transfer_timeout") from err
        buffer = torch.empty(int(info["max_chunk_bytes"]), dtype=torch.uint8, device=device)
        return cls(group, rank, size, backend, name, buffer)

    @staticmethod
    def check_rank(request: dict[str, Any]) -> None:
        """Raises (400) when the request's rank is not one of a member's (1..world_size-1)."""
        rank, size = request["rank_offset"], request["world_size"]
        if not 1 <= rank < size:
            raise WeightGroupError(
                f"rank_offset={rank} must be below world_size={size} (rank 0 is the trainer, "
                "the engines take 1..world_size-1)",
                400,
                "invalid_value",
                "rank_offset",
            )

    def describe(self) -> dict[str, Any]:
        return {"rank": self.rank, "world_size": self.world_size, "backend": self.backend,
                "group_name": self.group_name, "max_chunk_bytes": self.buffer.numel()}

    def receive(self, nbytes: int) -> torch.Tensor:
        """Join one broadcast of `nbytes` into the buffer (blocking); returns the buffer."""
        if nbytes > self.buffer.numel():
            raise WeightGroupError(f"chunk of {nbytes} bytes exceeds the group's max_chunk_bytes="
                                   f"{self.buffer.numel()}", 400, "invalid_value", "nbytes")
        broadcast_from_root(self.group, self.buffer[:nbytes])
        return self.buffer


def _await_start(store: dist.Store, name: str, seconds: float, where: str) -> None:
    """Wait until rank 0 says every member has announced itself, so that nobody enters the group's
    rendezvous (which cannot be interrupted and would wait the whole timeout) for a member that is
    gone: when one fails to join, rank 0 says `cancelled` and this fails at once."""
    deadline = time.monotonic() + seconds
    keys = [start_key(name, "go"), start_key(name, "cancelled")]
    while True:
        try:
            cancelled, go = store.check([keys[1]]), store.check([keys[0]])
        except (RuntimeError, OSError) as err:
            raise WeightGroupError(
                f"lost the weight-transfer master at {where} while the group formed: {err}",
                502,
                "weight_transfer_unreachable",
            ) from err
        if cancelled:
            raise WeightGroupError(f"the master at {where} stopped forming the weight group {name!r} (a "
                                   "member failed to join)", 502, "weight_transfer_failed")
        if go:
            return
        if time.monotonic() > deadline:
            raise WeightGroupError(
                f"the weight group {name!r} did not form within {seconds:g}s (are all ranks joining?)",
                504,
                "weight_transfer_timeout",
            )
        time.sleep(0.01)


def _check(request: dict[str, Any], info: dict, device: torch.device, where: str) -> str:
    """The backend to use; raises (400) when `request` does not describe the host's group."""
    name, size = request["group_name"], request["world_size"]
    backend = request.get("backend") or info.get("backend")
    if info.get("world_size") != size:
        message, param = (f"world_size={size} but the group {name!r} hosted at {where} has "
                          f"world_size={info.get('world_size')}"), "world_size"
    elif backend != info.get("backend"):
        message, param = f"backend={backend!r} but the group {name!r} uses {info.get('backend')!r}", "backend"
    elif backend == "nccl" and device.type != "cuda":
        message, param = f"the nccl backend needs a CUDA engine; this engine runs on {device}", "backend"
    else:
        return backend
    raise WeightGroupError(message, 400, "weight_transfer_mismatch", param)
