"""WorkerDispatch: drives this process's policy workers for training steps and weight syncs.

The sync policy is computed once, here, from the config and the transport
(`plan_weight_sync(cfg, transport.handles_prefix_cache_reset)`); rank 0's worker executes it
(`PolicyWorker.broadcast_to_inference_engines`) while the other ranks take part in gathering the
full weights. Call the same methods on every rank (SPMD); only rank 0 needs a client and transport.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

from inflight.config import Config
from inflight.train.batch import TrainBatch
from inflight.train.workers.base import PolicyWorker, SyncReport
from inflight.weight_sync.inprocess import InProcessTransport
from inflight.weight_sync.plan import SyncPlan, plan_weight_sync
from inflight.weight_sync.transport import WeightTransport


class WorkerDispatch:
    """The policy workers of this process, the engines' client and the weight transport."""

    def __init__(
        self,
        workers: Sequence[PolicyWorker],
        client: Any,
        transport: WeightTransport | None,
        cfg: Config,
    ) -> None:
        if not workers:
            raise ValueError("WorkerDispatch needs at least one worker")
        self.workers = list(workers)
        self.client = client
        self.transport = transport if transport is not None else InProcessTransport()
        self.cfg = cfg
        self.plan: SyncPlan = plan_weight_sync(cfg, self.transport.handles_prefix_cache_reset)
        self.weight_version = 0
        self.timings: dict[str, float] = {}
        self.history: list[dict[str, float]] = []
        self.failed_syncs = 0
        if any(w.rank == 0 for w in self.workers) and client is None:
            raise ValueError("the process holding rank 0 needs an inference client")

    def train_step(self, batches: Sequence[TrainBatch] | TrainBatch) -> list[dict[str, float]]:
        """One optimizer step on each local worker (one batch per worker)."""
        batches = [batches] if isinstance(batches, TrainBatch) else list(batches)
        if len(batches) != len(self.workers):
            raise ValueError(f"{len(batches)} batches for {len(self.workers)} workers")
        return [w.train_step(b) for w, b in zip(self.workers, batches, strict=True)]

    async def save_weights_for_sampler(self) -> SyncReport:
        """Push the current policy weights to the engines as the next weight version, following
        the plan. Returns rank 0's report (on other ranks: outcome and version only); raises when
        the sync failed (the engines then keep their old weights where they could restore them)."""
        started = time.perf_counter()
        base = self.weight_version
        if any(w.rank == 0 for w in self.workers):
            base = max(base, int(await self.client.weight_version()))
        version = base + 1
        try:
            reports = await asyncio.gather(*(self._sync(w, version) for w in self.workers))
        except BaseException:
            self.failed_syncs += 1
            raise
        report = next((r for w, r in zip(self.workers, reports, strict=True) if w.rank == 0), reports[0])
        self.weight_version = report.version
        self.timings = {
            **report.timings,
            "dispatch_s": time.perf_counter() - started,
            "version": report.version,
            "bytes": report.bytes,
            "chunks": report.chunks,
        }
        send = report.timings.get("send_s", 0.0)
        if send > 0 and report.bytes:
            self.timings["send_bytes_per_s"] = report.bytes / send
        self.history.append(self.timings)
        return report

    def _sync(self, worker: PolicyWorker, version: int):
        if worker.rank == 0:
            return worker.broadcast_to_inference_engines(self.client, self.plan, version, self.transport)
        if len(self.workers) == 1:
            return worker.broadcast_to_inference_engines(None, self.plan, version)
        # several ranks in one process: the others gather in threads so the collectives can meet
        return asyncio.to_thread(asyncio.run, worker.broadcast_to_inference_engines(None, self.plan, version))

    def metrics(self) -> dict[str, float]:
        """The last sync's timings under `weight_sync/` keys, plus the failure count."""
        return {f"weight_sync/{k}": v for k, v in self.timings.items()} | {
            "weight_sync/failed_syncs": self.failed_syncs
        }
