"""No wait on the dead in a weight broadcast group (issue 18): when a member process dies, rank 0's
broadcast fails at once (gloo: connection closed), but a live member whose data rank 0 had not sent
yet used to wait in that broadcast for the group's whole timeout (600 s by default). Rank 0 now
drops its side of the group on a failed broadcast, which closes its connections: the live member's
broadcast fails in about a second. Real processes, killed by PID; real gloo."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

from inflight.weight_sync.chunking import iter_chunks
from inflight.weight_sync.group import GroupHost

GROUP_TIMEOUT_S = 120  # what a stuck member would wait; the test gives it far less
MEMBER = textwrap.dedent("""
    import json, sys, time, torch
    from inflight.weight_sync.group import GroupMember
    request = json.loads(sys.argv[1])
    member = GroupMember.join(request, torch.device("cpu"))
    member.receive(int(sys.argv[2]))
    print("first", flush=True)
    started = time.monotonic()
    try:
        member.receive(int(sys.argv[2]))
        print("second", flush=True)
    except RuntimeError as err:
        print("failed after %.1f s: %s" % (time.monotonic() - started, str(err)[:120]), flush=True)
""")


def test_a_dead_member_does_not_leave_the_live_one_waiting_in_a_broadcast():
    host = GroupHost(3, "127.0.0.1", 0, timeout_s=GROUP_TIMEOUT_S, max_chunk_bytes=1 << 20)
    chunk = next(iter_chunks([("w", torch.ones(1 << 18))], 1 << 20, split=True))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    members = [
        subprocess.Popen(
            [sys.executable, "-c", MEMBER, json.dumps(host.init_request(rank)), str(chunk.nbytes)],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        for rank in (1, 2)
    ]
    try:
        host.connect()
        host.send(chunk)
        assert [m.stdout.readline().strip() for m in members] == ["first", "first"]
        members[0].send_signal(signal.SIGKILL)  # rank 1: the rank gloo's broadcast sends to first
        members[0].wait(10)
        with pytest.raises(RuntimeError):
            host.send(chunk)
        assert host.group is None  # dropped: it cannot broadcast again
        out, _ = members[1].communicate(timeout=30)  # bounded: far below the group's timeout
        assert out.startswith("failed after"), out
    finally:
        for m in members:
            if m.poll() is None:
                m.kill()
                m.wait(10)
