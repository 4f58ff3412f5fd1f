"""An inference engine in another process, and the clients that drive it: `ProcessClient` (a pipe to
an `EngineProcess` child) and `RayEngineClient` (calls to an engine actor's `call(op, *args)`).

Trainer and engine in two processes, each with its own torch threads, was measured the fastest
layout on a small CPU host: one Python process with both would serialise them on the GIL. Requests
and control calls travel as small pickled operations (`inflight.client.ops`; much lighter than
HTTP), batched: each message on the pipe is a list of the calls (or answers) one side had ready in
one turn of its event loop, so a group's samples cost one message, not one each (a message's
pickling and the wake-up of the other side's loop were most of the rollout loop's own time); the
weights do not: they go through a weight-sync transport whose receiver runs in the child
(`shm`: one flat shared-memory buffer allocated once; `broadcast`: a gloo/nccl group). With no
receiver `load_weights` pickles the tensors through the pipe, the slow path.

A child that dies fails every call waiting on it, and every later one, with an `EngineProcessError`
naming the engine, its pid and its exit code or signal; `EngineProcess.restart()` starts a new
child on the same config behind the same client, in a KEEP pause (`inflight.orchestration.engine_restarts`
decides when, and brings it to the current weights).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import pickle
import secrets
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Client, Connection, Listener
from typing import Any

import torch

from inflight.client.ops import JoiningClient, apply_op
from inflight.engine.async_engine import AsyncEngine
from inflight.engine.config import EngineConfig
from inflight.engine.engine import LLMEngine
from inflight.engine.heap import frozen_heap
from inflight.engine.step_threads import EngineThreads, base_threads
from inflight.weight_sync.kinds import TransportSpec


@dataclass
class ReceiverSpec:
    """Where the child's weight receiver connects: `transport` is the sender's kind (its registered
    `TransportSpec`, which builds the receiver); `rank` is this engine's receiver rank
    (1..`num_receivers`) among the engines the sender updates."""

    transport: TransportSpec
    host: str
    port: int
    device: str = "cpu"
    rank: int = 1
    num_receivers: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.transport, TransportSpec):
            raise TypeError(
                f"ReceiverSpec.transport must be a TransportSpec (weight_sync.transport_spec(name)), "
                f"got {type(self.transport).__name__} {self.transport!r}"
            )


class EngineProcessError(RuntimeError):
    """The engine process died or could not start."""


def start_receiver(engine: AsyncEngine, receiver: ReceiverSpec | None) -> None:
    """Serve weight updates from `receiver` into the engine, in a daemon thread (a broadcast
    receiver blocks until the sender forms the group, so it is built in that thread too)."""
    if receiver is None:
        return

    def serve() -> None:
        receiver.transport.build_receiver(receiver.host, receiver.port, rank=receiver.rank,
                                          num_receivers=receiver.num_receivers,
                                          device=receiver.device).serve(engine.engine)

    threading.Thread(target=serve, daemon=True, name="weight-receiver").start()


def no_delay(conn: Connection) -> Connection:
    """Turn off Nagle's algorithm on the pipe's TCP socket: `Connection.send` writes a message over
    16 KiB as two writes (length, then payload), and the second waited for the first's delayed
    ACK, 40 ms on Linux, whenever a batch of answers was that large."""
    sock = socket.socket(fileno=os.dup(conn.fileno()))  # the same socket; closing the copy leaves it open
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    finally:
        sock.close()
    return conn


def _portable(err: BaseException) -> BaseException:
    try:
        pickle.loads(pickle.dumps(err))
        return err
    except Exception:
        return RuntimeError(f"{type(err).__name__}: {err}")


def _main() -> None:
    """The child (`python -m inflight.client.process`): connect back, start the engine, serve its pipe."""
    host, port = os.environ["INFLIGHT_ENGINE_ADDRESS"].rsplit(":", 1)
    conn = no_delay(Client((host, int(port)), authkey=bytes.fromhex(os.environ["INFLIGHT_ENGINE_KEY"])))
    config, threads, receiver = conn.recv()
    torch.set_num_threads(base_threads(threads))
    try:
        engine = AsyncEngine(LLMEngine(config), threads=threads)
    except Exception as err:  # report start-up failures to the parent instead of dying silently
        conn.send([("ready", False, _portable(err))])
        return
    start_receiver(engine, receiver)
    conn.send([("ready", True, None)])
    with frozen_heap():
        asyncio.run(_serve(conn, engine))


class _Outbox:
    """Messages for one pipe, sent as one list at the end of the event loop's turn that queued the
    first of them (what else that turn queues goes with it, in order)."""

    def __init__(self, conn: Connection, loop: asyncio.AbstractEventLoop, lock: threading.Lock | None = None,
                 on_error: Callable[[list, BaseException], None] | None = None) -> None:
        self.conn, self.loop, self.lock = conn, loop, lock or threading.Lock()
        self.on_error = on_error  # (the unsent messages, the error); None: they are dropped
        self.queued: list = []

    def put(self, message: Any) -> None:
        self.queued.append(message)
        if len(self.queued) == 1:
            self.loop.call_soon(self.flush)

    def flush(self) -> None:
        messages, self.queued = self.queued, []
        if not messages:
            return
        try:
            with self.lock:
                self.conn.send(messages)
        except (BrokenPipeError, OSError) as err:
            if self.on_error is not None:
                self.on_error(messages, err)


async def _serve(conn: Connection, engine: AsyncEngine) -> None:
    loop = asyncio.get_running_loop()
    inbox: asyncio.Queue = asyncio.Queue()
    replies = _Outbox(conn, loop)

    def read() -> None:
        while True:
            try:
                calls = conn.recv()
            except (EOFError, OSError):
                calls = [None]
            loop.call_soon_threadsafe(_put_all, inbox, calls)
            if any(call is None or call[1] == "close" for call in calls):
                return

    threading.Thread(target=read, daemon=True, name="engine-inbox").start()
    tasks: set[asyncio.Task] = set()
    while True:
        call = await inbox.get()
        if call is None or call[1] == "close":
            break
        task = loop.create_task(_handle(replies, engine, *call))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    for task in tasks:
        task.cancel()
    await engine.close()
    replies.flush()
    if call is not None:
        with contextlib.suppress(BrokenPipeError, OSError):
            conn.send([(call[0], True, None)])


def _put_all(inbox: asyncio.Queue, items: list) -> None:
    for item in items:
        inbox.put_nowait(item)


async def _handle(replies: _Outbox, engine: AsyncEngine, call_id: int, op: str, args: tuple) -> None:
    try:
        reply = (call_id, True, await apply_op(engine, op, *args))
    except asyncio.CancelledError:
        return
    except Exception as err:
        reply = (call_id, False, _portable(err))
    replies.put(reply)


def describe_exit(code: int | None) -> str:
    """A child's exit status in words: `exit code 3`, `killed by signal 9 (SIGKILL)`, `still running`."""
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by signal {-code} ({signal.Signals(-code).name})"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


class EngineProcess:
    """Start an engine (`EngineConfig`) in a child process (`python -m inflight.client.process`,
    so the parent's `__main__` is never re-imported) with `threads` torch threads; weights come
    through `receiver` (None: through the pipe). `name` labels it in errors. Use as a context
    manager or call `close()`; `restart()` replaces a dead child behind the same `client`.
    `threads` as `EngineThreads`: the child adds those its trainer lends it, at each step."""

    def __init__(
        self,
        config: EngineConfig,
        threads: int | EngineThreads = 1,
        receiver: ReceiverSpec | None = None,
        start_timeout_s: float = 300.0,
        name: str = "engine",
    ) -> None:
        self.config, self.threads, self.receiver, self.name = config, threads, receiver, name
        self.start_timeout_s = start_timeout_s
        self.process, conn = self._spawn()
        self.client = ProcessClient(conn, self.process, name)

    def _spawn(self, paused: bool = False) -> tuple[subprocess.Popen, Connection]:
        """A started child and the pipe to it (with `paused`: already in a KEEP pause)."""
        timeout = self.start_timeout_s
        key = secrets.token_bytes(16)
        listener = Listener(("127.0.0.1", 0), authkey=key)
        host, port = listener.address
        env = dict(os.environ, INFLIGHT_ENGINE_ADDRESS=f"{host}:{port}", INFLIGHT_ENGINE_KEY=key.hex(),
                   OMP_NUM_THREADS=str(base_threads(self.threads)))
        process = subprocess.Popen([sys.executable, "-m", "inflight.client.process"], env=env)
        accepted: list = []
        waiter = threading.Thread(target=lambda: accepted.append(listener.accept()), daemon=True)
        waiter.start()
        waiter.join(timeout)
        listener.close()
        if not accepted:
            process.kill()
            raise EngineProcessError(f"the {self.name} process did not connect within {timeout:.0f} s "
                                     f"(exit code {process.poll()})")
        conn = no_delay(accepted[0])
        conn.send((self.config, self.threads, self.receiver))
        if paused:
            self._expect(process, conn, timeout)
            conn.send([(-1, "pause", ("keep",))])
        self._expect(process, conn, timeout)
        return process, conn

    def _expect(self, process: subprocess.Popen, conn: Connection, timeout: float) -> None:
        """Read the child's next answer during start-up; raise what it reports, or that it died."""
        if not conn.poll(timeout):
            process.kill()
            raise EngineProcessError(f"the {self.name} process did not start within {timeout:.0f} s")
        try:
            [(_, ok, err)] = conn.recv()
        except EOFError as eof:
            raise EngineProcessError(f"the {self.name} process exited during start-up "
                                     f"({describe_exit(process.wait(10))})") from eof
        if not ok:
            process.wait(10)
            raise err

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    def describe(self) -> str:
        """`engine-1 (pid 4242, killed by signal 9 (SIGKILL))`: who it is and how it ended."""
        return f"{self.name} (pid {self.process.pid}, {describe_exit(self.process.poll())})"

    def restart(self) -> None:
        """Start a new child on the same config (and receiver) in place of a dead one, in a KEEP
        pause (it runs nothing until resumed: a weight sync brings it to the current weights
        first); the same `client` then talks to it. Raises when the old child still runs."""
        if self.alive:
            raise EngineProcessError(f"{self.describe()} is alive; only a dead engine is restarted")
        process, conn = self._spawn(paused=True)
        self.client.attach(conn, process)
        self.process = process

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


class _Link:
    """One connection to one child: its pipe, the process, the calls waiting for its answers."""

    def __init__(self, conn: Connection, process: subprocess.Popen) -> None:
        self.conn, self.process = conn, process
        self.pending: dict[int, asyncio.Future] = {}
        self.error: EngineProcessError | None = None  # set once the child is gone
        self.reader: threading.Thread | None = None
        self.outbox: _Outbox | None = None  # made on the client's loop, at the first call


class ProcessClient(JoiningClient):
    """InferenceClient over the pipe to an `EngineProcess` (bound to the event loop of first use).
    When the child dies every waiting call fails with an `EngineProcessError` naming the engine,
    its pid and how it ended, and so does every later call until `attach` gives it a new child."""

    def __init__(self, conn: Connection, process: subprocess.Popen, name: str = "engine") -> None:
        self.name = name
        self._link = _Link(conn, process)
        self._ids = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._send_lock = threading.Lock()
        self._closed = False

    def attach(self, conn: Connection, process: subprocess.Popen) -> None:
        """Talk to a new child from now on (after the old one died); calls still waiting on the
        old one fail as it does."""
        old, self._link = self._link, _Link(conn, process)
        with contextlib.suppress(OSError):
            old.conn.close()

    def _ensure_reader(self, link: _Link) -> None:
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            if link.pending:
                raise RuntimeError("ProcessClient is in use on another event loop")
            self._loop = loop
        if link.outbox is None or link.outbox.loop is not loop:
            link.outbox = _Outbox(
                link.conn, loop, self._send_lock, lambda calls, err: self._unsent(link, calls)
            )
        if link.reader is None:
            link.reader = threading.Thread(
                target=self._read, args=(link,), daemon=True, name="engine-replies"
            )
            link.reader.start()

    def _read(self, link: _Link) -> None:
        while True:
            try:
                replies = link.conn.recv()
            except (EOFError, OSError):
                self._fail_all(link)
                return
            loop = self._loop
            if loop is not None and not loop.is_closed():
                loop.call_soon_threadsafe(self._resolve_all, link, replies)

    def _unsent(self, link: _Link, calls: list) -> None:
        """The pipe broke under a batch of calls: each fails naming the child and how it ended."""
        err = self._died(link, 0.0)
        for call_id, _, _ in calls:
            future = link.pending.pop(call_id, None)
            if future is not None and not future.done():
                future.set_exception(err)

    def _died(self, link: _Link, wait_s: float = 1.0) -> EngineProcessError:
        """The error of a child that is gone (its exit status, once it has one: `wait_s` at most)."""
        with contextlib.suppress(subprocess.TimeoutExpired):
            link.process.wait(wait_s)
        code = link.process.poll()
        return EngineProcessError(f"the engine process {self.name} (pid {link.process.pid}) exited: "
                                  f"{describe_exit(code)}")

    @staticmethod
    def _resolve_all(link: _Link, replies: list[tuple[int, bool, Any]]) -> None:
        for call_id, ok, value in replies:
            future = link.pending.pop(call_id, None)
            if future is None or future.done():
                continue
            if ok:
                future.set_result(value)
            else:
                future.set_exception(value)

    def _fail_all(self, link: _Link) -> None:
        err = self._died(link)
        loop = self._loop
        if loop is None or loop.is_closed():
            link.error = err
            return

        def fail() -> None:  # on the loop: a call registered before this ran is failed here
            link.error = err
            for future in link.pending.values():
                if not future.done():
                    future.set_exception(err)
            link.pending.clear()

        loop.call_soon_threadsafe(fail)

    async def _call(self, op: str, *args: Any) -> Any:
        if self._closed:
            raise EngineProcessError(f"the engine process {self.name} is closed")
        link = self._link
        if link.error is not None:
            raise link.error
        self._ensure_reader(link)
        call_id = next(self._ids)
        future = self._loop.create_future()
        link.pending[call_id] = future
        link.outbox.put((call_id, op, args))
        return await future

    def send_close(self) -> None:
        self._closed = True
        link = self._link
        unsent, link.outbox.queued = (link.outbox.queued, []) if link.outbox is not None else ([], [])
        with contextlib.suppress(BrokenPipeError, OSError):
            with self._send_lock:  # after what is queued: the child answers those before it closes
                link.conn.send([*unsent, (next(self._ids), "close", ())])

    def stop_reader(self) -> None:
        with contextlib.suppress(OSError):
            self._link.conn.close()


class RayEngineClient(JoiningClient):
    """InferenceClient over an engine actor's handle whose `call(op, *args)` runs `apply_op` (see
    `inflight.cluster.actors.EngineActor`; usable from the driver and from other actors)."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle

    async def _call(self, op: str, *args: Any) -> Any:
        return await self.handle.call.remote(op, *args)


if __name__ == "__main__":
    _main()
