"""Router: least outstanding requests, session affinity, avoiding servers that refused."""

from __future__ import annotations

import pytest

from inflight.client import Router

URLS = ["http://a", "http://b", "http://c"]


def test_least_outstanding_spreads_load():
    router = Router(URLS)
    picked = []
    for _ in range(6):
        url = router.pick()
        router.acquire(url)
        picked.append(url)
    assert sorted(picked) == sorted(URLS * 2)
    assert set(router.outstanding.values()) == {2}
    router.release("http://b")
    router.release("http://b")
    assert router.pick() == "http://b"


def test_session_affinity_sticks_even_when_busier():
    router = Router(URLS)
    first = router.pick(session_id="traj-1")
    router.acquire(first)
    router.acquire(first)
    assert router.pick(session_id="traj-1") == first  # keeps its prefix cache
    assert router.pick(session_id="traj-2") != first  # a new session goes to a less busy server
    assert router.session_server("traj-1") == first


def test_down_server_is_avoided_then_retried():
    router = Router(URLS[:2], down_cooldown_s=60)
    router.mark_down("http://a")
    assert {router.pick() for _ in range(5)} == {"http://b"}
    assert router.pick(session_id="s") == "http://b"
    router.mark_down("http://b")
    assert router.pick() in URLS[:2]  # all down: still pick one rather than fail
    router.mark_up("http://a")
    assert router.pick(avoid={"http://b"}) == "http://a"


def test_session_table_is_bounded():
    router = Router(URLS, max_sessions=10)
    for i in range(100):
        router.pick(session_id=f"s{i}")
    assert len(router._sessions) == 10 and router.session_server("s99") is not None
    assert router.session_server("s0") is None


def test_needs_a_url():
    with pytest.raises(ValueError):
        Router([])
