"""Torch threads lent to a run's engines while their trainer waits, read at every engine step.

The lender (`inflight.orchestration.thread_lending.ThreadLending`) writes how many threads each engine may
add to its own; every engine reads that count before each step, in the thread that steps it
(torch's thread count is per thread), and counts its steps by whether they ran with lent threads.
Engines in child processes read the same numbers: they live in a small file under /dev/shm mapped
by every process (a word per value, written by one side only), so a lending reaches an engine at
its next step without a message.
"""

from __future__ import annotations

import mmap
import os
import tempfile
import uuid
import weakref
from dataclasses import dataclass
from pathlib import Path

SHM_DIR = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
_WORD = 8  # bytes of one int64 value


class SharedThreads:
    """The threads lent to `engines` engines (`lent`, written by the lender) and each engine's step
    counts (`steps(i)`: at its own threads, with lent ones; written by that engine). Made by the
    lender (`path` None: a new file, removed by `close`); a pickled copy maps the same file."""

    def __init__(self, engines: int, path: str | None = None) -> None:
        if engines < 1:
            raise ValueError(f"engines={engines}: threads are shared with at least one engine")
        self.engines, self.owner = engines, path is None
        self.path = path or str(SHM_DIR / f"inflight-threads-{uuid.uuid4().hex}")
        size = _WORD * (1 + 2 * engines)
        fd = os.open(self.path, os.O_RDWR | (os.O_CREAT if self.owner else 0), 0o600)
        try:
            if self.owner:
                os.ftruncate(fd, size)
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self._words = memoryview(self._map).cast("q")
        self._finalizer = weakref.finalize(self, _release, self._words, self._map,
                                           self.path if self.owner else None)

    def __reduce__(self) -> tuple:
        return SharedThreads, (self.engines, self.path)

    @property
    def lent(self) -> int:
        """Threads each engine adds to its own at its next step."""
        return self._words[0]

    def lend(self, threads: int) -> None:
        """Lend each engine `threads` threads from its next step on (0: give them back)."""
        if threads < 0:
            raise ValueError(f"threads={threads}: cannot lend fewer than 0 threads")
        self._words[0] = threads

    def record(self, engine: int, lent: bool) -> None:
        """Engine `engine` ran a step, with lent threads or not."""
        self._words[2 + 2 * engine if lent else 1 + 2 * engine] += 1

    def steps(self, engine: int | None = None) -> tuple[int, int]:
        """Steps engine `engine` (None: all of them) ran at its own threads and with lent ones."""
        engines = range(self.engines) if engine is None else [engine]
        return (sum(self._words[1 + 2 * i] for i in engines), sum(self._words[2 + 2 * i] for i in engines))

    def close(self) -> None:
        """Unmap the file (and remove it, in the lender's process)."""
        self._finalizer()


def _release(words: memoryview, mapped: mmap.mmap, path: str | None) -> None:
    words.release()
    mapped.close()
    if path is not None:
        Path(path).unlink(missing_ok=True)


@dataclass(frozen=True)
class EngineThreads:
    """One engine's torch threads: its own (`base`) plus what `shared` lends it now; picklable, for
    an engine in a child process."""

    shared: SharedThreads
    index: int
    base: int

    def wanted(self) -> int:
        """The threads the next step computes with."""
        return self.base + self.shared.lent

    def stepped(self, threads: int) -> None:
        """The engine ran a step with `threads` threads."""
        self.shared.record(self.index, threads > self.base)


def base_threads(threads: int | EngineThreads) -> int:
    """An engine's own threads, lent or not."""
    return threads.base if isinstance(threads, EngineThreads) else threads
