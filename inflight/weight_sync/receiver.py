"""THE engine side of every cross-process weight path: `Receiver` joins a group, receives a
chunk's bytes, loads them, and runs the update's lifecycle.

A piece of a split weight goes to the engine as a `WeightPiece` (a view of the buffer), which the
engine copies straight into its range of the destination (the spare buffer or the parameter): no
weight is put back together in a temporary. Only LoRA adapter tensors, which the engine takes
whole (small, and copied to float32 anyway), are reassembled here.

Its control messages come from any channel: the sender's TCPStore `ControlChannel`
(`ChannelReceiver`, in a thread of the engine's process), the server's broadcast routes, or the
process / Ray client's operations (`engine_receiver(engine)`, the one receiver of an AsyncEngine).
Where the chunk's bytes come from is the channel's business: a shared-memory view, or a broadcast
into the group's buffer (`receive`). Once the group exists a chunk's broadcast is always joined,
even when the engine then refuses the tensors: skipping a collective would put this rank out of
step. A broadcast that fails drops the group.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import torch

from inflight.engine.adapters import adapter_part
from inflight.engine.async_engine import AsyncEngine
from inflight.engine.engine import LLMEngine
from inflight.engine.weight_copy import WeightPiece
from inflight.weight_sync.chunking import Reassembler, TensorMeta, chunk_metas, view_entry
from inflight.weight_sync.group import GroupMember, WeightGroupError
from inflight.weight_sync.transport import ControlChannel, TransportError


class Receiver:
    """Applies one sender's messages to one engine (an LLMEngine: its lock serialises every call
    with the step loop); a lock of its own keeps group calls in arrival order."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.reassembler = Reassembler()
        self.member: GroupMember | None = None
        self.updates = 0  # completed updates, for tests and logs
        self._lock = threading.Lock()

    # ---- the update's lifecycle ---------------------------------------------------------------
    def begin(self) -> None:
        self.reassembler.clear()
        self.engine.begin_weight_update()

    def load(self, metas: list[TensorMeta], buffer: torch.Tensor) -> int:
        """Load the chunk in `buffer` (tensors and pieces, as views of it); returns the number of
        tensors it completes (a split one counts with its last piece)."""
        entries: list[tuple[str, torch.Tensor | WeightPiece]] = []
        adapter_pieces, completed = [], 0
        for meta in metas:
            if meta.whole:
                entries.append((meta.name, view_entry(meta, buffer)))
                completed += 1
            elif adapter_part(meta.name) is not None:
                adapter_pieces.append(meta)
            else:
                entries.append((meta.name, WeightPiece(view_entry(meta, buffer), meta.start, meta.shape)))
                completed += meta.start + meta.numel == meta.total_numel  # pieces arrive in order
        adapters = self.reassembler.add(adapter_pieces, buffer)
        if entries or adapters:
            self.engine.load_weights(entries + adapters)
        return completed + len(adapters)

    def finish(self, version: int | None) -> int:
        if self.reassembler.incomplete:  # the engine refuses its own incomplete split weights
            raise TransportError(f"split tensors never completed: {self.reassembler.incomplete}")
        new_version = self.engine.finish_weight_update(version)
        self.updates += 1
        return new_version

    def abort(self) -> bool:
        self.reassembler.clear()
        return bool(self.engine.abort_weight_update())

    def clear_pieces(self) -> None:
        """Forget pieces of split adapter tensors (a new or abandoned update begun outside this
        receiver; the engine forgets its own pieces on begin and abort)."""
        self.reassembler.clear()

    # ---- the group ----------------------------------------------------------------------------
    def join(self, request: dict[str, Any]) -> dict[str, Any]:
        """Join the group `request` describes (`GroupHost.init_request`), replacing the one in place
        only once the new one has formed (blocking)."""
        GroupMember.check_rank(request)
        with self._lock:
            if self.member is not None and not request.get("override_existing", True):
                raise WeightGroupError(f"this engine is already in weight group {self.member.group_name!r}; "
                                       "pass override_existing=true or destroy it first",
                                       409, "weight_transfer_group_exists")
            self.member = GroupMember.join(request, torch.device(self.engine.device))
            self.reassembler.clear()
            return self.member.describe()

    def receive(self, metadata: dict[str, Any]) -> int:
        """Join the broadcast of one chunk (`WeightChunk.metadata()`), load what it completes;
        returns the tensors loaded."""
        metas = chunk_metas(metadata)
        with self._lock:
            member = self.member
            if member is None:
                raise WeightGroupError("this engine is in no weight broadcast group; call "
                                       "init_weight_transfer() (/init_weight_update_communicator) first",
                                       409, "no_weight_transfer_group")
            try:
                buffer = member.receive(int(metadata["nbytes"]))
            except RuntimeError as err:
                if isinstance(err, WeightGroupError):
                    raise
                self.member = None
                raise WeightGroupError("the weight broadcast failed; the group is dropped and must be "
                                       f"re-initialised: {err}") from err
            return self.load(metas, buffer)

    def leave(self) -> bool:
        """Leave the group; True when there was one."""
        with self._lock:
            had, self.member = self.member is not None, None
            return had

    def describe(self) -> dict[str, Any] | None:
        return None if self.member is None else self.member.describe()

    def close(self) -> None:
        """Drop the group without waiting for a chunk in progress (shutdown)."""
        self.member = None


def _unwrap_engine(target: Any) -> LLMEngine:
    """An LLMEngine from an LLMEngine, AsyncEngine or LocalClient."""
    while (inner := getattr(target, "engine", None)) is not None:
        target = inner
    return target


class ChannelReceiver:
    """A `Receiver` fed by the sender's TCPStore `ControlChannel` (the `shm` and `broadcast`
    transports); subclasses say where a chunk's bytes are (`chunk_buffer`).

    Run `serve(engine)` in a thread of the engine's process; it returns when the sender closes the
    transport. Engine errors are sent back to the sender, which raises them; the receiver keeps
    serving.
    """

    def __init__(self, channel: ControlChannel) -> None:
        self.channel = channel
        self.receiver: Receiver | None = None
        self._thread: threading.Thread | None = None

    @property
    def updates(self) -> int:
        """Completed updates, for tests and logs."""
        return 0 if self.receiver is None else self.receiver.updates

    def chunk_buffer(self, message: dict) -> torch.Tensor:
        """The buffer holding the chunk `message` describes (transport-specific)."""
        raise NotImplementedError

    def serve(self, engine: Any) -> None:
        """Apply messages to `engine` (an LLMEngine, AsyncEngine or LocalClient) until closed."""
        receiver = self.receiver = Receiver(_unwrap_engine(engine))
        while True:
            message = self.channel.recv()
            if message["op"] == "close":
                self.channel.ack({"ok": True, "result": None})
                return
            try:
                reply = {"ok": True, "result": self._apply(receiver, message)}
            except Exception as err:  # reported to the sender, which raises it there
                reply = {"ok": False, "type": type(err).__name__, "error": str(err)}
            self.channel.ack(reply)

    def _apply(self, receiver: Receiver, message: dict) -> Any:
        op = message["op"]
        if op == "begin":
            return receiver.begin()
        if op == "chunk":
            return receiver.load(chunk_metas(message["chunk"]), self.chunk_buffer(message))
        if op == "finish":
            return receiver.finish(message["version"])
        if op == "abort":
            return receiver.abort()
        raise TransportError(f"unknown weight-sync operation {op!r}")

    def serve_in_thread(self, engine: Any) -> threading.Thread:
        """Start `serve(engine)` in a daemon thread and return it."""
        self._thread = threading.Thread(
            target=self.serve, args=(engine,), daemon=True, name="weight-receiver"
        )
        self._thread.start()
        return self._thread


_RECEIVERS: weakref.WeakKeyDictionary[AsyncEngine, Receiver] = weakref.WeakKeyDictionary()


def engine_receiver(engine: AsyncEngine) -> Receiver:
    """The (one) receiver of an AsyncEngine's group calls (the server's routes, the client
    operations), created on first use; call it in a worker thread (its calls block)."""
    if engine not in _RECEIVERS:
        _RECEIVERS[engine] = Receiver(engine.engine)
    return _RECEIVERS[engine]
