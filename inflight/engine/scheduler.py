"""Continuous batching over a token budget: chunked prefill, mixed prefill/decode, preemption.

Every step the running requests are served first (oldest first); when blocks run out the newest
running request is preempted by recompute (blocks freed, tokens kept, back to the front of the
queue). Waiting requests are admitted after a prefix-cache lookup keyed by the current weight
version (none for a request whose prompt logprobs are still to be computed). The backstop: a request holding a
block from an older KV epoch (the pool was discarded) is reset before anything is scheduled, so no request
ever attends to discarded KV. The BlockPool makes every block decision; schedule() returns what it did and the
engine books the counts.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from inflight.engine.blocks import BlockPool
from inflight.engine.request import Request, RequestStatus


@dataclass
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    enable_chunked_prefill: bool = True


@dataclass
class SchedulerOutput:
    """What one schedule() did: the model step to run, and counts named as in EngineStats."""

    scheduled: list[tuple[Request, int]] = field(default_factory=list)  # (request, new tokens)
    kv_invalidated_resets: int = 0
    preemptions: int = 0
    prefix_cache_queried_tokens: int = 0
    prefix_cache_hit_tokens: int = 0
    recomputed_tokens: int = 0


class Scheduler:
    """The waiting and running queues over a BlockPool."""

    def __init__(self, config: SchedulerConfig, pool: BlockPool) -> None:
        self.config = config
        self.pool = pool
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.admission_cutoff: int | None = None  # when set, only arrivals <= cutoff are admitted
        self._checked_epoch = pool.epoch

    # ---- queue management -------------------------------------------------------------------
    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def unfinished(self) -> list[Request]:
        return list(self.running) + list(self.waiting)

    def has_unfinished(self) -> bool:
        return bool(self.running or self.waiting)

    def finish(self, request: Request, reason: str) -> None:
        """Mark finished with `reason`, free its blocks and drop it from the queues."""
        self.pool.release(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)

    def reset(self, request: Request) -> None:
        """Drop a request's KV (blocks freed, computed tokens 0, tokens kept); it is re-prefilled."""
        self.pool.release(request)
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
            request.status = RequestStatus.WAITING
            self.waiting.appendleft(request)

    def reset_all(self) -> int:
        """Reset every request that holds KV, keeping queue order; returns how many."""
        victims = [r for r in self.unfinished() if r.block_ids]
        for request in reversed(victims):
            self.reset(request)
        return len(victims)

    def invalidate_stale_kv(self) -> int:
        """The backstop: reset requests holding blocks written before the last KV discard;
        returns how many."""
        if self._checked_epoch == self.pool.epoch:
            return 0
        stale = [r for r in self.unfinished() if self.pool.holds_stale_kv(r)]
        for request in reversed(stale):
            self.reset(request)
        self._checked_epoch = self.pool.epoch
        return len(stale)

    # ---- scheduling ---------------------------------------------------------------------------
    def schedule(self, weight_version: int) -> SchedulerOutput:
        """Choose (request, number of new tokens) pairs for one model step within the budget."""
        out = SchedulerOutput(kv_invalidated_resets=self.invalidate_stale_kv())
        budget = self.config.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            n = self._num_new_tokens(request, budget)
            if n == 0 or not self._allocate_or_preempt(request, n, weight_version, out):
                break
            out.scheduled.append((request, n))
            budget -= n
            i += 1
        while (
            not out.preemptions
            and self.waiting
            and budget > 0
            and len(self.running) < self.config.max_num_seqs
        ):
            request = self.waiting[0]
            if self.admission_cutoff is not None and request.arrival > self.admission_cutoff:
                break
            # cached KV has no logits: a request whose prompt is still to be scored reads no prefix
            # (vLLM's rule); it still publishes its blocks for others
            hit = 0 if request.needs_prompt_logprobs else self.pool.match_prefix(request, weight_version)
            n = self._num_new_tokens(request, budget)
            if n == 0 or not self.pool.allocate_slots(request, n, weight_version):
                self.reset(request)  # gives back the prefix blocks it just took
                break
            if self.pool.enable_prefix_caching:
                request.num_cached_tokens += hit
                out.prefix_cache_queried_tokens += request.num_tokens
                out.prefix_cache_hit_tokens += hit
            request.status = RequestStatus.RUNNING
            self.running.append(self.waiting.popleft())
            out.scheduled.append((request, n))
            budget -= n
        for request, n in out.scheduled:  # the tokens below the high-water mark are computed again
            start = request.num_computed_tokens
            again = max(0, min(start + n, request.max_computed_tokens) - start)
            request.num_recomputed_tokens += again
            out.recomputed_tokens += again
        return out

    def after_step(self, scheduled: list[tuple[Request, int]]) -> None:
        """Advance computed tokens and publish newly full blocks to the prefix cache."""
        for request, n in scheduled:
            request.num_computed_tokens += n
            request.max_computed_tokens = max(request.max_computed_tokens, request.num_computed_tokens)
            self.pool.publish(request)

    # ---- helpers ------------------------------------------------------------------------------
    def _num_new_tokens(self, request: Request, budget: int) -> int:
        remaining = request.num_tokens - request.num_computed_tokens
        if self.config.enable_chunked_prefill:
            return min(remaining, budget)
        return remaining if remaining <= budget else 0

    def _allocate_or_preempt(
        self, request: Request, n: int, weight_version: int, out: SchedulerOutput
    ) -> bool:
        """Make room for `request` by preempting the newest running requests; False when it was
        itself preempted."""
        while not self.pool.allocate_slots(request, n, weight_version):
            victim = self.running[-1]
            self.reset(victim)
            out.preemptions += 1
            if victim is request:
                return False
        return True
