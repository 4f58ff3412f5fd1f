"""Helpers shared by the benchmarks: timing, matmul peak, isolation in a subprocess, CPU contention."""

from __future__ import annotations

import multiprocessing as mp
import os
import resource
import statistics
import threading
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from typing import Any, TypeVar

from inflight.backends.vllm.venv import SYSTEM_LIB_DIRS, TCMALLOC_NAMES, find_library  # noqa: F401  (re-exported)
from inflight.bench.matmul_peak import matmul_peak_flops  # noqa: F401  (re-exported)

T = TypeVar("T")
_HZ = os.sysconf("SC_CLK_TCK")


# ---- the benchmark models (transformers config overrides of a Qwen2 shape) ----------------------
MODEL_SHAPES: dict[str, dict[str, int]] = {
    "tiny": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
        max_position_embeddings=512,
    ),
    "demo": dict(
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=1024,
        max_position_embeddings=1024,
    ),
    "50m": dict(
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=13,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=8192,
        max_position_embeddings=1024,
    ),
    "500m": dict(
        hidden_size=1280,
        intermediate_size=3456,
        num_hidden_layers=24,
        num_attention_heads=20,
        num_key_value_heads=4,
        vocab_size=32000,
        max_position_embeddings=1024,
    ),
    # Qwen2.5-1.5B's shape (1.54B parameters, tied embeddings)
    "1.5b": dict(
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        vocab_size=151936,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
    ),
}


def median(values: list[float]) -> float:
    return float(statistics.median(values))


def timed(fn: Callable[[], T]) -> tuple[float, T]:
    """Run `fn` once; returns (seconds, result)."""
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def peak_rss_mib() -> float:
    """Peak resident memory of this process (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class Worker:
    """One spawned process kept alive across calls: its own memory and threads, state between calls.

    `call(fn, *args)` runs a module-level function there (arguments and result picklable); functions
    keep state across calls in module globals of the worker process.
    """

    def __init__(self, env: dict[str, str] | None = None) -> None:
        """`env`: variables set in the worker's environment from its start (LD_PRELOAD needs that)."""
        self._pool = ProcessPoolExecutor(max_workers=1, mp_context=mp.get_context("spawn"))
        if env:
            saved = {key: os.environ.get(key) for key in env}
            os.environ.update(env)
            try:  # the pool starts its process at the first call, from this thread: now
                self._pool.submit(os.getpid).result()
            finally:
                for key, value in saved.items():
                    if value is None:
                        os.environ.pop(key, None)
                    else:
                        os.environ[key] = value

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        return self._pool.submit(fn, *args).result()

    def __enter__(self) -> Worker:
        return self

    def __exit__(self, *exc: object) -> None:
        self._pool.shutdown()


# ---- CPU used by processes that are not ours ------------------------------------------------------
def _read_procs() -> dict[int, tuple[int, str, int, int]]:
    """pid -> (ppid, name, utime + stime, that + cutime + cstime), in jiffies, for every process."""
    procs = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        # 0-based from the state field: ppid is 1, then utime, stime, cutime, cstime are 11..14
        own = int(fields[11]) + int(fields[12])
        procs[int(entry)] = (int(fields[1]), name, own, own + int(fields[13]) + int(fields[14]))
    return procs


def _busy_jiffies() -> int:
    with open("/proc/stat") as f:
        values = [int(x) for x in f.readline().split()[1:9]]
    return sum(values) - values[3] - values[4]  # minus idle and iowait


def _ours(procs: dict[int, tuple[int, str, int, int]]) -> set[int]:
    """This process and its live descendants."""
    ours, frontier = {os.getpid()}, [os.getpid()]
    children: dict[int, list[int]] = {}
    for pid, (ppid, *_) in procs.items():
        children.setdefault(ppid, []).append(pid)
    while frontier:
        for child in children.get(frontier.pop(), []):
            ours.add(child)
            frontier.append(child)
    return ours


class CpuMonitor:
    """Samples, in a background thread, how many cores processes outside this process tree use.

    Our own time includes reaped children (cutime/cstime), so subprocesses that exit between samples
    are not mistaken for other load. Use as a context manager; read `summary()` afterwards.
    """

    def __init__(self, interval_s: float = 1.0) -> None:
        self.interval_s = interval_s
        self.samples: list[float] = []
        self.times: list[float] = []  # time.monotonic() at the end of each sample
        self.by_name: dict[str, float] = {}  # core-seconds of other processes, by command name
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> CpuMonitor:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        prev_t, prev_busy, prev = time.monotonic(), _busy_jiffies(), _read_procs()
        while not self._stop.wait(self.interval_s):
            now_t, busy, procs = time.monotonic(), _busy_jiffies(), _read_procs()
            ours = _ours(procs)
            # reaped children move into their parent's cutime/cstime: count those for our tree
            ours_delta = sum(procs[p][3] - (prev[p][3] if p in prev else 0) for p in ours)
            other = max(0.0, (busy - prev_busy - ours_delta) / _HZ / (now_t - prev_t))
            self.samples.append(other)
            self.times.append(now_t)
            for pid, (_, name, jiffies, _) in procs.items():
                if pid not in ours and pid in prev and jiffies > prev[pid][2]:
                    self.by_name[name] = self.by_name.get(name, 0.0) + (jiffies - prev[pid][2]) / _HZ
            prev_t, prev_busy, prev = now_t, busy, procs

    def mean_between(self, start: float, end: float) -> float:
        """Mean cores used by others during [start, end] (monotonic times), from the samples that
        overlap it; call after the monitor stopped. NaN when no sample overlaps."""
        picked = [
            v for t, v in zip(self.times, self.samples, strict=True) if start < t < end + self.interval_s
        ]
        return round(statistics.fmean(picked), 3) if picked else float("nan")

    def summary(self) -> dict[str, Any]:
        """Mean and max cores used by others, and the busiest other commands (core-seconds)."""
        top = sorted(self.by_name.items(), key=lambda kv: -kv[1])[:5]
        return {
            "mean_other_cores": round(statistics.fmean(self.samples), 3) if self.samples else 0.0,
            "max_other_cores": round(max(self.samples), 3) if self.samples else 0.0,
            "samples": len(self.samples),
            "top_other_processes": [{"name": n, "core_seconds": round(s, 2)} for n, s in top if s >= 0.05],
        }


def tree_cpu_seconds(roots: list[int]) -> float:
    """CPU seconds used so far by the processes `roots` and their live descendants (reaped
    children included through cutime/cstime)."""
    procs = _read_procs()
    children: dict[int, list[int]] = {}
    for pid, (ppid, *_) in procs.items():
        children.setdefault(ppid, []).append(pid)
    seen, frontier = set(), [r for r in roots if r in procs]
    while frontier:
        pid = frontier.pop()
        if pid not in seen:
            seen.add(pid)
            frontier.extend(children.get(pid, []))
    return sum(procs[p][3] for p in seen) / _HZ


def busy_cpu_seconds() -> float:
    """CPU seconds all CPUs spent busy since boot (not idle, not waiting for I/O), all processes."""
    return _busy_jiffies() / _HZ


def settle(
    pids: list[int], window_s: float = 0.25, max_cores: float = 0.05, timeout_s: float = 10.0
) -> None:
    """Wait until the sides' processes are idle: vLLM's keep a core busy for about a second after
    a pass, which would otherwise land in the next side's pass."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        before = tree_cpu_seconds(pids)
        time.sleep(window_s)
        if tree_cpu_seconds(pids) - before <= max_cores * window_s:
            return


def cpu_name() -> str:
    """The CPU's model name (its family and model numbers) and how many CPUs this process sees."""
    from inflight.engine.cpu import cpu_family_model, cpu_model

    return f"{cpu_model()} ({cpu_family_model()}), {os.cpu_count()} CPUs"
