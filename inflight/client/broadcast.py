"""Weight updates over a `torch.distributed` broadcast group, the trainer's side (rank 0).

The SkyRL / vLLM shape: the trainer hosts a rendezvous store at master address:port and asks every
inference server (over HTTP, `/init_weight_update_communicator`) to join a group of `world_size`
ranks at its rank offset. An update is then driven over HTTP (`begin`, one `/weight_update/broadcast`
per chunk, `finish`) while the chunk's bytes travel over the group: for each chunk the trainer posts
its metadata (names, dtypes, shapes and where each tensor sits in a flat buffer) to every server and
broadcasts the flat buffer; each server receives it, rebuilds the tensors and loads them.

The group is a `ProcessGroupGloo` (CPU) or `ProcessGroupNCCL` (CUDA) object over the store, outside
torch.distributed's registry (see `inflight.weight_sync.broadcast.make_group`), so it never clashes
with the trainer's own default group. The server side is `inflight.server.weight_transfer`.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from inflight.client.wire import DEFAULT_WEIGHT_GROUP
from inflight.weight_sync.broadcast import default_backend, make_group
from inflight.weight_sync.chunking import DEFAULT_CHUNK_BYTES, WeightChunk, iter_chunks, pack_chunk


def info_key(group_name: str) -> str:
    """The store key where rank 0 posts the group's world size, backend and chunk capacity."""
    return f"{group_name}/info"


def joining_key(group_name: str, rank: int) -> str:
    """The store key a server sets once it has checked the group and is about to join it."""
    return f"{group_name}/joining/{rank}"


def group_store(store: dist.Store, group_name: str) -> dist.PrefixStore:
    """The part of the rendezvous store that the group named `group_name` forms over."""
    return dist.PrefixStore(f"{group_name}/", store)


def broadcast_from_root(group: dist.ProcessGroup, tensor: torch.Tensor) -> None:
    """Broadcast `tensor` from rank 0 of `group` (blocking: sender and receivers alike)."""
    options = dist.BroadcastOptions()
    options.rootRank = 0
    options.rootTensor = 0
    group.broadcast([tensor], options).wait()


def in_daemon_thread(fn: Callable[..., Any], *args: Any) -> asyncio.Future:
    """Run a blocking call in a daemon thread; the returned future holds its result.

    Not `asyncio.to_thread`: a collective whose peers never join blocks until the group's timeout,
    and such a thread must neither hold up the event loop's shutdown nor the interpreter's exit.
    """
    loop = asyncio.get_running_loop()
    future: asyncio.Future = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if future.done():
            return
        if error is None:
            future.set_result(result)
        else:
            future.set_exception(error)

    def run() -> None:
        try:
            outcome: tuple[Any, BaseException | None] = (fn(*args), None)
        except BaseException as err:  # handed to the awaiting coroutine
            outcome = (None, err)
        try:
            loop.call_soon_threadsafe(settle, *outcome)
        except RuntimeError:  # the loop is closed: nobody is waiting any more
            pass

    threading.Thread(target=run, daemon=True, name=f"weight-broadcast-{fn.__name__}").start()
    future.add_done_callback(lambda f: f.cancelled() or f.exception())  # never "never retrieved"
    return future


class WeightBroadcaster:
    """Rank 0 of a weight broadcast group: hosts the rendezvous store, sends each chunk's bytes.

    `master_port=0` picks a free port (see `.port`). The servers join at ranks 1..world_size-1
    (`init_request(rank_offset)` is the body of their init route); `connect()` blocks until all
    have joined. Chunks hold at most `max_chunk_bytes` (larger tensors travel in pieces), so one
    buffer of that size is all either side allocates.
    """

    def __init__(
        self,
        world_size: int,
        master_address: str = "127.0.0.1",
        master_port: int = 0,
        *,
        backend: str | None = None,
        device: str | torch.device = "cpu",
        group_name: str = DEFAULT_WEIGHT_GROUP,
        max_chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        dtype: torch.dtype | None = None,
        timeout_s: float = 600.0,
    ) -> None:
        if world_size < 2:
            raise ValueError(
                f"world_size={world_size}: a broadcast group needs rank 0 and at least one server"
            )
        self.world_size = world_size
        self.master_address = master_address
        self.device = torch.device(device)
        self.backend = backend or default_backend(self.device)
        self.group_name = group_name
        self.max_chunk_bytes = int(max_chunk_bytes)
        self.dtype = dtype
        self.timeout_s = timeout_s
        timeout = datetime.timedelta(seconds=timeout_s)
        self.store: dist.TCPStore | None = dist.TCPStore(
            master_address, master_port, world_size, True, timeout=timeout, wait_for_workers=False
        )
        self.port = self.store.port
        info = {"world_size": world_size, "backend": self.backend, "max_chunk_bytes": self.max_chunk_bytes}
        self.store.set(info_key(group_name), json.dumps(info))
        self.buffer = torch.empty(self.max_chunk_bytes, dtype=torch.uint8, device=self.device)
        self.group: dist.ProcessGroup | None = None

    def init_request(self, rank_offset: int) -> dict[str, Any]:
        """The JSON body that makes a server join this group at rank `rank_offset`."""
        return {
            "master_address": self.master_address,
            "master_port": self.port,
            "rank_offset": rank_offset,
            "world_size": self.world_size,
            "group_name": self.group_name,
            "backend": self.backend,
            "timeout_s": self.timeout_s,
        }

    def connect(self, cancel: threading.Event | None = None) -> None:
        """Form the group (blocks until every server has joined, or raises after the timeout).

        Rank 0 enters the group only once every server has announced that it is joining, so that
        `cancel` (set when a server refused) can still stop the wait: the group's own rendezvous
        cannot be interrupted.
        """
        store = self.store  # close() may drop it while this runs in a thread
        if store is None:
            raise RuntimeError("this WeightBroadcaster is closed")
        if self.group is not None:
            return
        self._wait_for_servers(store, cancel or threading.Event())
        timeout = datetime.timedelta(seconds=self.timeout_s)
        self.group = make_group(
            group_store(store, self.group_name), 0, self.world_size, self.backend, timeout
        )

    def _wait_for_servers(self, store: dist.Store, cancel: threading.Event) -> None:
        keys = [joining_key(self.group_name, rank) for rank in range(1, self.world_size)]
        deadline = time.monotonic() + self.timeout_s
        while not store.check(keys):
            if cancel.wait(0.01):
                raise RuntimeError("forming the weight broadcast group was cancelled")
            if time.monotonic() > deadline:
                raise TimeoutError(f"not every server joined the weight group within {self.timeout_s:g}s")

    def chunks(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[WeightChunk]:
        """The chunks to send for these tensors (lazy, in order)."""
        return iter_chunks(named_tensors, self.max_chunk_bytes, split=True, dtype=self.dtype)

    def send(self, chunk: WeightChunk) -> None:
        """Broadcast the chunk's bytes (blocks until every server has received them)."""
        if self.group is None:
            raise RuntimeError("the weight broadcast group is not formed; call connect() first")
        nbytes = pack_chunk(chunk, self.buffer)
        broadcast_from_root(self.group, self.buffer[:nbytes])

    def close(self) -> None:
        """Drop the group and the store (idempotent; the servers drop theirs on their own route)."""
        self.group = None
        self.store = None
