"""`frozen_heap`: what is alive on entry leaves the collector's generations for the duration,
setup garbage is collected first, and everything is back in the generations afterwards, also
after an error."""

from __future__ import annotations

import gc
import weakref

import pytest

from inflight.engine.heap import frozen_heap


class Node:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only the collector frees it


def test_the_heap_is_frozen_within_and_setup_garbage_is_freed_first():
    kept, dropped = Node(), Node()
    dropped_ref = weakref.ref(dropped)
    del dropped
    with frozen_heap():
        assert dropped_ref() is None  # collected, not frozen
        assert gc.get_freeze_count() > 1000
        assert not any(o is kept for o in gc.get_objects())  # out of every generation
        made_inside = Node()
        assert any(o is made_inside for o in gc.get_objects(generation=0))
    assert gc.get_freeze_count() == 0
    assert any(o is kept for o in gc.get_objects())


def test_the_heap_is_unfrozen_after_an_error():
    with pytest.raises(RuntimeError, match="boom"), frozen_heap():
        raise RuntimeError("boom")
    assert gc.get_freeze_count() == 0
