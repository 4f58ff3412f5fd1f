"""An inference engine in another process, and the clients that drive it: `ProcessClient` (a pipe to
an `EngineProcess` child) and `RayEngineClient` (calls to an engine actor's `call(op, *args)`).

Trainer and engine in two processes, each with its own torch threads, was measured the fastest
layout on a small CPU host: one Python process with both would serialise them on the GIL. Requests
and control calls travel as small pickled operations (`inflight.client.ops`; much lighter than
HTTP); the weights do not: they go through a weight-sync transport whose receiver runs in the child
(`shm`: one flat shared-memory buffer allocated once; `broadcast`: a gloo/nccl group). With no
receiver `load_weights` pickles the tensors through the pipe, the slow path.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import pickle
import secrets
import subprocess
import sys
import threading
from dataclasses import dataclass
from multiprocessing.connection import Client, Connection, Listener
from typing import Any

import torch

from inflight.client.ops import JoiningClient, apply_op
from inflight.engine.async_engine import AsyncEngine
from inflight.engine.config import EngineConfig


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


def start_receiver(engine: AsyncEngine, receiver: ReceiverSpec | None) -> None:
    """Serve weight updates from `receiver` into the engine, in a daemon thread (a broadcast
    receiver blocks until the sender forms the group, so it is built in that thread too)."""
    if receiver is None:
        return
    from inflight.weight_sync import make_receiver  # on use: the weight-sync layer

    def serve() -> None:
        make_receiver(receiver.kind, receiver.host, receiver.port, rank=receiver.rank,
                      num_receivers=receiver.num_receivers, device=receiver.device).serve(engine.engine)

    threading.Thread(target=serve, daemon=True, name="weight-receiver").start()


def _portable(err: BaseException) -> BaseException:
    try:
        pickle.loads(pickle.dumps(err))
        return err
    except Exception:
        return RuntimeError(f"{type(err).__name__}: {err}")


def _child_main(conn: Connection, config: EngineConfig, threads: int, receiver: ReceiverSpec | None) -> None:
    torch.set_num_threads(threads)
    from inflight.engine import LLMEngine

    try:
        engine = AsyncEngine(LLMEngine(config))
    except Exception as err:  # report start-up failures to the parent instead of dying silently
        conn.send(("ready", False, _portable(err)))
        return
    start_receiver(engine, receiver)
    conn.send(("ready", True, None))
    asyncio.run(_serve(conn, engine))


async def _serve(conn: Connection, engine: AsyncEngine) -> None:
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


async def _handle(conn: Connection, engine: AsyncEngine, call_id: int, op: str, args: tuple) -> None:
    try:
        reply = (call_id, True, await apply_op(engine, op, *args))
    except asyncio.CancelledError:
        return
    except Exception as err:
        reply = (call_id, False, _portable(err))
    try:
        conn.send(reply)
    except (BrokenPipeError, OSError):
        pass


class EngineProcess:
    """Start an engine (`EngineConfig`) in a child process (`python -m inflight.client.process`,
    so the parent's `__main__` is never re-imported) with `threads` torch threads; weights come
    through `receiver` (None: through the pipe). Use as a context manager or call `close()`."""

    def __init__(self, config: EngineConfig, threads: int = 1, receiver: ReceiverSpec | None = None,
                 start_timeout_s: float = 300.0) -> None:
        key = secrets.token_bytes(16)
        listener = Listener(("127.0.0.1", 0), authkey=key)
        host, port = listener.address
        env = dict(os.environ, INFLIGHT_ENGINE_ADDRESS=f"{host}:{port}", INFLIGHT_ENGINE_KEY=key.hex(),
                   OMP_NUM_THREADS=str(threads))
        self.process = subprocess.Popen([sys.executable, "-m", "inflight.client.process"], env=env)
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


class ProcessClient(JoiningClient):
    """InferenceClient over the pipe to an `EngineProcess` (bound to the event loop of first use)."""

    def __init__(self, conn: Connection, process: subprocess.Popen) -> None:
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

    async def _call(self, op: str, *args: Any) -> Any:
        if self._closed:
            raise EngineProcessError("the engine process is closed")
        self._ensure_reader()
        call_id = next(self._ids)
        future = self._loop.create_future()
        self._pending[call_id] = future
        with self._send_lock:
            self._conn.send((call_id, op, args))
        return await future

    def send_close(self) -> None:
        self._closed = True
        try:
            with self._send_lock:
                self._conn.send((next(self._ids), "close", ()))
        except (BrokenPipeError, OSError):
            pass

    def stop_reader(self) -> None:
        try:
            self._conn.close()
        except OSError:
            pass


class RayEngineClient(JoiningClient):
    """InferenceClient over an engine actor's handle whose `call(op, *args)` runs `apply_op` (see
    `inflight.cluster.actors.EngineActor`; usable from the driver and from other actors)."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle

    async def _call(self, op: str, *args: Any) -> Any:
        return await self.handle.call.remote(op, *args)


def _main() -> None:
    host, port = os.environ["INFLIGHT_ENGINE_ADDRESS"].rsplit(":", 1)
    conn = Client((host, int(port)), authkey=bytes.fromhex(os.environ["INFLIGHT_ENGINE_KEY"]))
    config, threads, receiver = conn.recv()
    _child_main(conn, config, threads, receiver)


if __name__ == "__main__":
    _main()
