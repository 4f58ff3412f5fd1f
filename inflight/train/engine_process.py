"""An inference engine in a child process, and `ProcessClient`, the InferenceClient that drives it.

Trainer and engine in two processes, each with its own torch threads, was measured the fastest
layout on a small CPU host (docs: /work/shared/CALIBRATION.md): one Python process with both would
serialise them on the GIL. Requests and control calls travel over a `multiprocessing` pipe as small
pickled messages (much lighter than HTTP); the weights do not: they go through a weight-sync
transport whose receiver runs in the child (`shm`: one flat shared-memory buffer allocated once;
`broadcast`: a gloo/nccl group). With `weights="pipe"` (no receiver) `load_weights` pickles the
tensors through the pipe, the slow path.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import secrets
import subprocess
import sys
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from multiprocessing.connection import Client, Listener
from typing import Any

import torch

from inflight.client.fanout import HostsWeightGroup
from inflight.engine.config import EngineConfig
from inflight.engine.request import RequestOutput, SamplingParams
from inflight.train.engine_weight_group import engine_weight_group


@dataclass
class ReceiverSpec:
    """Where the child's weight receiver connects: `kind` is `shm` or `broadcast`; `rank` is this
    engine's receiver rank (1..`num_receivers`) among the engines the sender updates."""

    kind: str
    host: str
    port: int
    device: str = "cpu"
    rank: int = 1
    num_receivers: int = 1


class EngineProcessError(RuntimeError):
    """The engine process died or could not start."""


def _make_receiver(spec: ReceiverSpec):
    from inflight.weight_sync import make_receiver

    return make_receiver(spec.kind, spec.host, spec.port, rank=spec.rank, num_receivers=spec.num_receivers,
                         device=spec.device)


def _child_main(conn, config: EngineConfig, threads: int, receiver: ReceiverSpec | None) -> None:
    torch.set_num_threads(threads)
    from inflight.engine import AsyncEngine, LLMEngine

    try:
        engine = AsyncEngine(LLMEngine(config))
    except Exception as err:  # report start-up failures to the parent instead of dying silently
        conn.send(("ready", False, _portable(err)))
        return
    start_receiver(engine, receiver)
    conn.send(("ready", True, None))
    asyncio.run(_serve(conn, engine))


def _portable(err: BaseException) -> BaseException:
    import pickle

    try:
        pickle.loads(pickle.dumps(err))
        return err
    except Exception:
        return RuntimeError(f"{type(err).__name__}: {err}")


async def _serve(conn, engine) -> None:
    loop = asyncio.get_running_loop()
    inbox: asyncio.Queue = asyncio.Queue()

    def read() -> None:
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                message = None
            loop.call_soon_threadsafe(inbox.put_nowait, message)
            if message is None or message[1] == "close":
                return

    threading.Thread(target=read, daemon=True, name="engine-inbox").start()
    tasks: set[asyncio.Task] = set()
    while True:
        message = await inbox.get()
        if message is None or message[1] == "close":
            break
        task = loop.create_task(_handle(conn, engine, *message))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    for task in tasks:
        task.cancel()
    await engine.close()
    if message is not None:
        conn.send((message[0], True, None))


async def apply_op(engine, op: str, args: tuple = (), kwargs: dict | None = None) -> Any:
    """Run one InferenceClient operation (`generate`, `pause`, ..., plus `stats` and
    `weight_version`) on an AsyncEngine; what the engine side of every remote client does."""
    kwargs = kwargs or {}
    if op == "stats":
        return engine.engine.stats.as_dict()
    if op == "weight_version":
        return engine.weight_version
    if op == "pause":
        await engine.pause(*args, **kwargs)
        return None
    if op in GROUP_OPS:
        return await getattr(engine_weight_group(engine), GROUP_OPS[op])(*args, **kwargs)
    if op not in CLIENT_OPS:
        raise ValueError(f"unknown engine operation {op!r}")
    if op in ("begin_weight_update", "abort_weight_update"):
        engine_weight_group(engine).clear_pieces()
    return await getattr(engine, op)(*args, **kwargs)


CLIENT_OPS = frozenset({
    "generate", "pause", "resume", "sleep", "wake_up", "reset_prefix_cache", "begin_weight_update",
    "load_weights", "finish_weight_update", "abort_weight_update", "weight_version", "stats",
})
GROUP_OPS = {"join_weight_group": "join", "receive_weight_chunk": "receive", "leave_weight_group": "leave"}
"""Operations on the engine's membership of a weight broadcast group its client hosts."""


def start_receiver(engine, receiver: ReceiverSpec | None) -> None:
    """Serve weight updates from `receiver` into the engine, in a daemon thread (a broadcast
    receiver blocks until the sender forms the group, so it is built in that thread too)."""
    if receiver is not None:
        threading.Thread(target=lambda: _make_receiver(receiver).serve(engine.engine), daemon=True,
                         name="weight-receiver").start()


async def _handle(conn, engine, call_id: int, op: str, args: tuple, kwargs: dict) -> None:
    try:
        reply = (call_id, True, await apply_op(engine, op, args, kwargs))
    except asyncio.CancelledError:
        return
    except Exception as err:
        reply = (call_id, False, _portable(err))
    try:
        conn.send(reply)
    except (BrokenPipeError, OSError):
        pass


class EngineProcess:
    """Start an engine (`EngineConfig`) in a child process (`python -m inflight.train.engine_process`,
    so the parent's `__main__` is never re-imported) with `threads` torch threads; weights come
    through `receiver` (None: through the pipe). Use as a context manager or call `close()`."""

    def __init__(self, config: EngineConfig, threads: int = 1, receiver: ReceiverSpec | None = None,
                 start_timeout_s: float = 300.0) -> None:
        key = secrets.token_bytes(16)
        listener = Listener(("127.0.0.1", 0), authkey=key)
        host, port = listener.address
        env = dict(os.environ, INFLIGHT_ENGINE_ADDRESS=f"{host}:{port}", INFLIGHT_ENGINE_KEY=key.hex(),
                   OMP_NUM_THREADS=str(threads))
        self.process = subprocess.Popen([sys.executable, "-m", "inflight.train.engine_process"], env=env)
        accepted: list = []
        waiter = threading.Thread(target=lambda: accepted.append(listener.accept()), daemon=True)
        waiter.start()
        waiter.join(start_timeout_s)
        listener.close()
        if not accepted:
            self.process.kill()
            raise EngineProcessError(f"the engine process did not connect within {start_timeout_s:.0f} s "
                                     f"(exit code {self.process.poll()})")
        self._conn = accepted[0]
        self._conn.send((config, threads, receiver))
        if not self._conn.poll(start_timeout_s):
            self.process.kill()
            raise EngineProcessError(f"the engine process did not start within {start_timeout_s:.0f} s")
        try:
            _, ok, err = self._conn.recv()
        except EOFError as eof:
            raise EngineProcessError(f"the engine process exited during start-up (code {self.process.poll()})") from eof
        if not ok:
            self.process.wait(10)
            raise err
        self.client = ProcessClient(self._conn, self.process)

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the engine process (politely, then by force)."""
        if self.process.poll() is None:
            self.client.send_close()
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout_s)
        self.client.stop_reader()

    def __enter__(self) -> EngineProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class OpClient(HostsWeightGroup):
    """The InferenceClient protocol over one coroutine, `_call(op, *args)`, that runs the operation
    on a remote AsyncEngine (`apply_op` on the other side): the pipe client and the Ray client.
    Weight updates over a broadcast group: this process hosts it, the engine joins at rank 1."""

    async def _call(self, op: str, *args: Any, **kwargs: Any) -> Any:
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

    # ---- weight updates over a broadcast group this process hosts (see HostsWeightGroup) -----------
    def _group_members(self) -> dict[str, Any]:
        return {"engine": self}

    async def join_weight_group(self, request: dict[str, Any]) -> dict[str, Any]:
        """Have the engine join a weight group hosted elsewhere (`WeightBroadcaster.init_request`)."""
        return await self._call("join_weight_group", request)

    async def receive_weight_chunk(self, metadata: dict[str, Any]) -> int:
        """Have the engine join one chunk's broadcast and load what it completes."""
        return await self._call("receive_weight_chunk", metadata)

    async def leave_weight_group(self) -> bool:
        return await self._call("leave_weight_group")

    async def close(self) -> None:
        """Leave the weight group if any (best effort); whoever started the engine stops it."""
        try:
            await self.close_weight_transfer()
        except Exception:  # an engine that is gone has no group to leave
            pass


class ProcessClient(OpClient):
    """InferenceClient over the pipe to an `EngineProcess` (bound to the event loop of first use)."""

    def __init__(self, conn, process) -> None:
        self._conn, self._process = conn, process
        self._ids = itertools.count()
        self._pending: dict[int, asyncio.Future] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._reader: threading.Thread | None = None
        self._send_lock = threading.Lock()
        self._closed = False

    def _ensure_reader(self) -> None:
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            if self._pending:
                raise RuntimeError("ProcessClient is in use on another event loop")
            self._loop = loop
        if self._reader is None:
            self._reader = threading.Thread(target=self._read, daemon=True, name="engine-replies")
            self._reader.start()

    def _read(self) -> None:
        while True:
            try:
                call_id, ok, value = self._conn.recv()
            except (EOFError, OSError):
                self._fail_all(EngineProcessError(f"the engine process exited (code {self._process.poll()})"))
                return
            loop = self._loop
            if loop is not None and not loop.is_closed():
                loop.call_soon_threadsafe(self._resolve, call_id, ok, value)

    def _resolve(self, call_id: int, ok: bool, value: Any) -> None:
        future = self._pending.pop(call_id, None)
        if future is None or future.done():
            return
        if ok:
            future.set_result(value)
        else:
            future.set_exception(value)

    def _fail_all(self, err: Exception) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return

        def fail() -> None:
            for future in self._pending.values():
                if not future.done():
                    future.set_exception(err)
            self._pending.clear()

        loop.call_soon_threadsafe(fail)

    async def _call(self, op: str, *args: Any, **kwargs: Any) -> Any:
        if self._closed:
            raise EngineProcessError("the engine process is closed")
        self._ensure_reader()
        call_id = next(self._ids)
        future = self._loop.create_future()
        self._pending[call_id] = future
        with self._send_lock:
            self._conn.send((call_id, op, args, kwargs))
        return await future

    def send_close(self) -> None:
        self._closed = True
        try:
            with self._send_lock:
                self._conn.send((next(self._ids), "close", (), {}))
        except (BrokenPipeError, OSError):
            pass

    def stop_reader(self) -> None:
        try:
            self._conn.close()
        except OSError:
            pass


async def engine_stats(client: Any) -> dict[str, int] | None:
    """Engine counters from a ProcessClient or LocalClient (None for clients that cannot tell)."""
    stats = getattr(client, "stats", None)
    if callable(stats):
        return await stats()
    engine = getattr(client, "engine", None)
    inner = getattr(engine, "engine", engine)
    counters = getattr(inner, "stats", None)
    return counters.as_dict() if counters is not None and hasattr(counters, "as_dict") else None


def _main() -> None:
    host, port = os.environ["INFLIGHT_ENGINE_ADDRESS"].rsplit(":", 1)
    conn = Client((host, int(port)), authkey=bytes.fromhex(os.environ["INFLIGHT_ENGINE_KEY"]))
    config, threads, receiver = conn.recv()
    _child_main(conn, config, threads, receiver)


if __name__ == "__main__":
    _main()
