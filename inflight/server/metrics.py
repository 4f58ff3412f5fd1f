"""Prometheus metrics of one server: the engine's counters and state, read at scrape time.

Every `EngineStats` counter is exported as `inflight_<name>_total`; gauges give running and waiting
requests, KV-cache usage, prefix-cache hit rate, weight version, paused/asleep, and tokens/s over
the last `window_s` seconds (sampled once a second). HTTP requests are counted by route and status.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from inflight.engine.async_engine import AsyncEngine

__all__ = ["CONTENT_TYPE_LATEST", "ServerMetrics"]

_STAT_HELP = {
    "steps": "engine steps that ran the model",
    "prompt_tokens_computed": "prompt tokens run through the model (first time)",
    "generated_tokens": "tokens sampled",
    "prefix_cache_queried_tokens": "prompt tokens looked up in the prefix cache",
    "prefix_cache_hit_tokens": "prompt tokens served by the prefix cache",
    "preemptions": "requests preempted (recomputed later)",
    "resets": "requests reset on request (reset_prefix_cache with reset_running_requests)",
    "kv_invalidated_resets": "requests reset because their KV had been discarded",
    "recomputed_tokens": "tokens recomputed after a preemption or reset",
    "finished_requests": "requests finished (including aborted ones)",
    "aborted_requests": "requests aborted",
    "pauses": "pause() calls that paused the engine",
    "weight_updates": "completed weight updates",
    "failed_weight_updates": "rejected weight updates",
}


class _EngineCollector:
    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics

    def collect(self):
        stats, status = self.metrics.engine.stats, self.metrics.engine.status()
        for name, value in stats.as_dict().items():
            yield CounterMetricFamily(f"inflight_{name}", _STAT_HELP.get(name, name), value=value)
        queried = stats.prefix_cache_queried_tokens
        gen_rate, prompt_rate = self.metrics.rates()
        loop = status.step_loop
        gauges = {
            "requests_running": ("requests being generated (including frozen ones)", status.num_running),
            "requests_waiting": ("requests waiting to be scheduled", status.num_waiting),
            "kv_cache_usage": ("fraction of KV blocks in use (0..1)", status.kv_cache_usage),
            "prefix_cache_hit_rate": (
                "prefix-cache hit tokens / queried tokens since start",
                stats.prefix_cache_hit_tokens / queried if queried else 0.0,
            ),
            "weight_version": ("the engine's weight version", status.weight_version),
            "paused": ("1 while the engine is paused", int(status.paused)),
            "weights_awake": ("1 while the weights pool is allocated", int(status.weights_awake)),
            "kv_cache_awake": ("1 while the KV pool is allocated", int(status.kv_cache_awake)),
            "generation_tokens_per_second": ("sampled tokens per second, recent window", gen_rate),
            "prompt_tokens_per_second": ("prompt tokens computed per second, recent window", prompt_rate),
            "step_loop_stalled": (
                "1 while runnable work has gone unstepped for the stall limit",
                int(loop.stalled),
            ),
            "requests_awaited": ("engine requests that callers are waiting on", loop.waiters),
            "seconds_since_step": (
                "seconds since the step loop last looked for work",
                loop.seconds_since_step,
            ),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(f"inflight_{name}", doc, value=float(value))
        yield CounterMetricFamily("inflight_missed_wakeups", "work the step loop's idle backstop found "
                                  "that no wake-up announced", value=loop.missed_wakeups)


class ServerMetrics:
    """The server's registry: engine metrics plus HTTP request counts and latencies."""

    def __init__(self, engine: AsyncEngine, window_s: float = 10.0) -> None:
        self.engine = engine
        self.window_s = window_s
        self._samples: deque[tuple[float, int, int]] = deque()
        self.sample()
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_EngineCollector(self))
        self.http_requests = Counter("inflight_http_requests", "HTTP requests answered", ["route", "status"],
                                     registry=self.registry)
        self.request_latency = Histogram(
            "inflight_request_latency_seconds",
            "time to answer a generation request",
            ["route"],
            registry=self.registry,
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600),
        )

    def sample(self) -> None:
        stats = self.engine.stats
        now = time.monotonic()
        self._samples.append((now, stats.generated_tokens, stats.prompt_tokens_computed))
        while len(self._samples) > 2 and now - self._samples[1][0] >= self.window_s:
            self._samples.popleft()

    def rates(self) -> tuple[float, float]:
        self.sample()
        (t0, g0, p0), (t1, g1, p1) = self._samples[0], self._samples[-1]
        if t1 - t0 <= 0:
            return 0.0, 0.0
        return (g1 - g0) / (t1 - t0), (p1 - p0) / (t1 - t0)

    async def run_sampler(self, interval_s: float = 1.0) -> None:
        """Sample the token counters every `interval_s` (the tokens/s window); runs until cancelled."""
        while True:
            await asyncio.sleep(interval_s)
            self.sample()

    def render(self) -> bytes:
        return generate_latest(self.registry)
