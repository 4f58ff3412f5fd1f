"""A sender waiting for a receiver whose process died fails in seconds, not after the channel's
timeout (600 s by default): issue 18 finding 2 (with gloo, the abort after a dead engine waited the
full timeout). Real TCPStore channel, a real process killed by PID."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest

from inflight.weight_sync.transport import ControlChannel, TransportError


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_dead_receiver_process_fails_the_wait_at_once():
    channel = ControlChannel("127.0.0.1", _free_port(), num_receivers=1, timeout=600)
    engine = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    channel.dead_receivers = lambda: [] if engine.poll() is None else [1]
    try:
        engine.kill()
        engine.wait(timeout=10)
        started = time.monotonic()
        with pytest.raises(TransportError, match=r"receiver 1's process died .*'abort'"):
            channel.send({"op": "abort"})
        assert time.monotonic() - started < 30  # ALIVE_CHECK_S slices, not the 600 s timeout
        assert 1 in channel.stopped
    finally:
        if engine.poll() is None:
            engine.kill()


def test_a_live_receiver_that_answers_is_waited_for(monkeypatch):
    """The slices do not change a normal exchange: the answer that comes after a few slices arrives."""
    import threading

    from inflight.weight_sync import transport

    monkeypatch.setattr(transport, "ALIVE_CHECK_S", 0.05)
    port = _free_port()
    sender = ControlChannel("127.0.0.1", port, num_receivers=1, timeout=60)
    sender.dead_receivers = lambda: []
    receiver = ControlChannel("127.0.0.1", port, num_receivers=1, rank=1, timeout=60)

    def answer() -> None:
        message = receiver.recv()
        time.sleep(0.3)  # several of the sender's slices
        receiver.ack({"ok": True, "result": message["op"]})

    thread = threading.Thread(target=answer)
    thread.start()
    assert sender.send_checked({"op": "begin"}) == ["begin"]
    thread.join()


def test_forming_a_broadcast_group_with_a_dead_receiver_fails_at_once():
    """The broadcast transport's group waits for every receiver to join (its whole timeout, 120 s
    here); a receiver whose process is dead never will: the wait ends within a check or two."""
    import threading

    from inflight.weight_sync import BroadcastTransport

    transport = BroadcastTransport("127.0.0.1", 0, num_receivers=1, timeout=120)
    engine = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    transport.channel.dead_receivers = lambda: [] if engine.poll() is None else [1]
    outcome: list[BaseException] = []

    def connect() -> None:
        try:
            transport.connect()
        except BaseException as err:  # the outcome is the test's
            outcome.append(err)

    thread = threading.Thread(target=connect, daemon=True)
    try:
        thread.start()
        engine.kill()
        engine.wait(timeout=10)
        thread.join(30)  # bounded: far below the group's timeout
        assert not thread.is_alive() and len(outcome) == 1
        assert isinstance(outcome[0], TransportError) and "died while the group formed" in str(outcome[0])
    finally:
        transport.close()
        if engine.poll() is None:
            engine.kill()
