"""Shared-memory transport: trainer and engine processes on one host.

The sender keeps a ring of chunk buffers in shared memory, one file per slot under /dev/shm (mapped
by `torch.from_file(shared=True)`), made once and reused for every chunk of every update:
re-sharing tensors each step (a `torch.multiprocessing` queue) costs more than it saves (measured
on 2 CPU cores). A chunk is packed into a slot with one memcpy per tensor (the `dtype` cast rides
on it); the slot's first 8 bytes hold the pack's number, which the chunk's message repeats, so a
receiver never reads a slot that was overwritten or not yet written. A slot is packed again only
once the receivers have answered the message about its last chunk. The metadata travels over the
control channel; the receiver rebuilds the tensors (and pieces of split ones) as views of its own
mapping of the slot and calls the engine's `load_weights`, which copies each straight into its
place in the parameters' storage: with the pack, the only copies.

Two ways to fill the ring:
- **staged** (`weight_sync_staged`, the default): `stage` packs the whole update before the sync
  pauses the engines, growing the ring to one slot per chunk (once; later updates reuse it), so the
  pause holds only the engines' copy out of shared memory. The ring grows only while /dev/shm and
  the host's available memory keep `RESERVE_BYTES` free beyond it; a chunk that finds no room is
  packed during the pause instead, as below.
- **pipelined**: the sender packs chunk k+1 into one slot while the engine copies chunk k out of
  another; the pause then holds both copies, overlapped on two cores but sharing one memory bus.

On CUDA the same protocol would carry a CUDA tensor shared once through its IPC handle
(`torch.multiprocessing.reductions.reduce_tensor`, rebuilt with `rebuild_cuda_tensor` on the
engine's device) instead of a /dev/shm file; that path is not implemented here.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import shutil
import tempfile
import uuid
import weakref
from collections import deque
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from inflight.weight_sync.chunking import ALIGN, DEFAULT_CHUNK_BYTES, WeightChunk, align, pack_chunk
from inflight.weight_sync.kinds import SenderSite
from inflight.weight_sync.receiver import ChannelReceiver
from inflight.weight_sync.transport import (
    ChannelTransport,
    ControlChannel,
    Posted,
    StagedUpdate,
    TransportError,
    checked,
)

HEADER = ALIGN  # bytes before a slot's data: the int64 pack number, padded to the alignment
MIN_SLOTS = 2  # the ring's floor: the sender packs one slot while the engine reads the other
RESERVE_BYTES = 1 << 30
"""Shared memory and available memory a staged update leaves free (it packs during the pause beyond)."""

SHM_DIR = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
"""Where the weight buffers' shared files live (the temporary directory on a system without /dev/shm)."""
SHM_PREFIX = "inflight-weights-train-"
"""The start of a run's buffer files (`build_sender`), followed by the trainer's pid."""


def slot_path(prefix: str, index: int) -> str:
    """The file of slot `index` of the ring whose files start with `prefix`."""
    return f"{prefix}-{index}"


class _Slot:
    """One chunk buffer: its pack number and its data, views of one mapping of the slot's file."""

    def __init__(self, path: str, capacity: int) -> None:
        self.buffer = torch.from_file(path, shared=True, size=HEADER + align(capacity), dtype=torch.uint8)
        self.pack = self.buffer[:8].view(torch.int64)
        self.data = self.buffer[HEADER:]


def _available_memory() -> int:
    """The host's available memory in bytes (Linux's MemAvailable; unbounded elsewhere)."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 1 << 62


def _unlink_all(paths: list[str]) -> None:
    for path in paths:
        Path(path).unlink(missing_ok=True)


class ShmTransport(ChannelTransport):
    """Sender: packs chunks into the shared ring; lifecycle and metadata over the control channel.

    `host`/`port`: where this sender hosts the control store (receivers connect to it).
    `max_chunk_bytes` is a slot's capacity; larger tensors are sent in pieces. `staged`: `stage`
    packs the update before the engines pause (module docstring).
    """

    name = "shm"
    split_tensors = True

    def __init__(self, host: str = "127.0.0.1", port: int = 0, num_receivers: int = 1,
                 max_chunk_bytes: int = DEFAULT_CHUNK_BYTES, dtype: torch.dtype | None = None,
                 timeout: float = 600.0, path: str | None = None, staged: bool = True) -> None:
        super().__init__(max_chunk_bytes, dtype)
        self.path = path or str(SHM_DIR / f"inflight-weights-{uuid.uuid4().hex}")
        self.staged = staged
        self.paths: list[str] = []  # every slot's file, unlinked on close
        self._finalizer = weakref.finalize(self, _unlink_all, self.paths)
        self.slots: list[_Slot] = []
        for _ in range(MIN_SLOTS):
            self._add_slot()
        self._next_slot = 0
        self._packs = 0  # packs so far: the number each slot's header and its message carry
        self._packed: dict[int, tuple[WeightChunk, int, int]] = {}  # id(chunk) -> (chunk, slot, pack), staged
        self._in_flight: deque[tuple[Posted, int]] = deque()  # (chunk message, its slot), oldest first
        self.channel = ControlChannel(host, port, num_receivers, rank=0, timeout=timeout)
        self.port = self.channel.store.port  # the port actually bound (port=0 picks a free one)
        self.channel.store.set("shm/info", f"{self.path}\n{self.max_chunk_bytes}")

    # ---- the ring -------------------------------------------------------------------------------
    def _add_slot(self) -> None:
        path = slot_path(self.path, len(self.slots))
        self.paths.append(path)
        self.slots.append(_Slot(path, self.max_chunk_bytes))

    def _can_grow(self) -> bool:
        """Whether one more slot leaves RESERVE_BYTES of shared and of available memory free."""
        need = HEADER + align(self.max_chunk_bytes) + RESERVE_BYTES
        return min(shutil.disk_usage(SHM_DIR).free, _available_memory()) >= need

    def _pack(self, chunk: WeightChunk, slot: int) -> int:
        """Pack `chunk` into `slot` (free: no unanswered message reads it); returns its pack number."""
        self._packs += 1
        buffer = self.slots[slot]
        buffer.pack.fill_(-1)  # a reader that raced the pack sees no valid number
        pack_chunk(chunk, buffer.data)
        buffer.pack.fill_(self._packs)
        return self._packs

    def _free(self, slot: int) -> None:
        """Collect answers until no unanswered message reads `slot`."""
        while any(used == slot for _, used in self._in_flight):
            self._collect_oldest()

    # ---- staging --------------------------------------------------------------------------------
    async def stage(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> StagedUpdate | Iterable:
        if not self.staged:
            return named_tensors
        return await asyncio.to_thread(self._stage, named_tensors)

    def _stage(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> StagedUpdate:
        self._settle()  # an earlier update's messages are answered: every slot is free
        self._packed.clear()
        chunks = super().chunks(named_tensors)
        staged: list[WeightChunk] = []
        for chunk in chunks:
            slot = len(staged)
            if slot == len(self.slots):
                if not self._can_grow():  # the rest is packed as it is sent, through the ring
                    self._next_slot = 0
                    return StagedUpdate(itertools.chain(staged, [chunk], chunks))
                self._add_slot()
            self._packed[id(chunk)] = (chunk, slot, self._pack(chunk, slot))
            staged.append(chunk)
        self._next_slot = len(staged) % len(self.slots)
        return StagedUpdate(iter(staged))

    def chunks(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]] | StagedUpdate
    ) -> Iterator[WeightChunk]:
        if isinstance(named_tensors, StagedUpdate):
            return named_tensors.chunks
        self._packed.clear()  # an unsent staged update is dropped
        return super().chunks(named_tensors)

    # ---- sending --------------------------------------------------------------------------------
    def _send_bytes(self, chunk: WeightChunk, message: dict) -> list:
        packed = self._packed.pop(id(chunk), None)
        if packed is not None and packed[0] is chunk:
            _, slot, pack = packed
        else:
            slot, self._next_slot = self._next_slot, (self._next_slot + 1) % len(self.slots)
            self._free(slot)
            pack = self._pack(chunk, slot)
        self._in_flight.append((self.channel.post({**message, "slot": slot, "pack": pack}), slot))
        return []

    def _collect_oldest(self) -> None:
        """Collect the oldest chunk message's answers; raises the first receiver error (after
        which nothing is in flight)."""
        posted, _ = self._in_flight.popleft()  # collected once: its keys are gone after that
        try:
            checked(self.channel.collect(posted))
        except BaseException:
            self._drop_in_flight()
            raise

    def _settle(self) -> None:
        """Collect every chunk message's answers; raises the first receiver error."""
        while self._in_flight:
            self._collect_oldest()

    def _drop_in_flight(self) -> None:
        """After a failure: collect what the receivers still answer, ignoring their errors."""
        while self._in_flight:
            with contextlib.suppress(Exception):  # the failure being handled is the one reported
                self.channel.collect(self._in_flight.popleft()[0])

    async def finish(self, client: Any, version: int) -> int:
        await asyncio.to_thread(self._settle)
        return await super().finish(client, version)

    async def abort(self, client: Any) -> bool:
        self._packed.clear()
        await asyncio.to_thread(self._drop_in_flight)
        return await super().abort(client)

    def close(self) -> None:
        if self._finalizer.alive:
            self._in_flight.clear()
            self.close_receivers()
            self._finalizer()


class ShmReceiver(ChannelReceiver):
    """Engine side: maps the sender's slots (each on first use) and loads views of them into the engine."""

    def __init__(self, host: str, port: int, rank: int = 1, num_receivers: int = 1,
                 timeout: float = 600.0) -> None:
        super().__init__(ControlChannel(host, port, num_receivers, rank=rank, timeout=timeout))
        self.path, capacity = self.channel.store.get("shm/info").decode().split("\n")
        self.capacity = int(capacity)
        self.slots: dict[int, _Slot] = {}

    def chunk_buffer(self, message: dict) -> torch.Tensor:
        index = int(message.get("slot", 0))
        if index not in self.slots:
            self.slots[index] = _Slot(slot_path(self.path, index), self.capacity)
        pack = int(self.slots[index].pack.item())
        if pack != message["pack"]:
            raise TransportError(
                f"shared buffer slot {index} holds the bytes of pack {pack}, not {message['pack']}"
            )
        return self.slots[index].data


def remove_stale_shm_buffers() -> None:
    """Unlink the shared-memory weight buffers of trainers that died without cleaning up (killed):
    their file names carry the trainer's pid."""
    for path in SHM_DIR.glob(SHM_PREFIX + "*"):
        try:
            pid = int(path.name[len(SHM_PREFIX):].split("-", 1)[0])
            os.kill(pid, 0)
        except ProcessLookupError:  # that trainer is gone
            path.unlink(missing_ok=True)
        except (ValueError, PermissionError):  # no pid in the name; alive, someone else's
            pass


def build_sender(site: SenderSite) -> ShmTransport:
    """The `shm` kind's sender (`TransportSpec.sender`): its buffer is named after this process, so
    a later run removes it if this one gets killed (and this one removes those of killed trainers)."""
    remove_stale_shm_buffers()
    path = str(SHM_DIR / f"{SHM_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}")
    return ShmTransport(site.host, site.port, site.num_receivers, site.max_chunk_bytes, timeout=site.timeout,
                        path=path, staged=site.staged)


def build_receiver(host: str, port: int, *, rank: int = 1, num_receivers: int = 1, device: Any = "cpu",
                   timeout: float = 600.0) -> ShmReceiver:
    """The `shm` kind's receiver (`TransportSpec.receiver`): the engine's device does not apply."""
    return ShmReceiver(host, port, rank=rank, num_receivers=num_receivers, timeout=timeout)
