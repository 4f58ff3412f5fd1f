"""Continuous batching over a token budget: chunked prefill, mixed prefill/decode, preemption.

Every step the running requests are served first (oldest first); when blocks run out the newest
running request is preempted by recompute (blocks freed, tokens kept, back to the front of the
queue). Waiting requests are admitted after a prefix-cache lookup keyed by the current weight
version. The backstop: a request holding a block from an older KV epoch (the pool was discarded) is
reset before anything is scheduled, so no request ever attends to discarded KV.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from inflight.engine.blocks import BlockPool, chain_hash
from inflight.engine.request import Request, RequestStatus
from inflight.engine.stats import EngineStats


@dataclass
class SchedulerConfig:
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    enable_chunked_prefill: bool = True


class Scheduler:
    def __init__(self, config: SchedulerConfig, pool: BlockPool, stats: EngineStats) -> None:
        self.config = config
        self.pool = pool
        self.stats = stats
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
        self._free_blocks(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)

    def reset(self, request: Request) -> None:
        """Drop a request's KV (blocks freed, computed tokens 0, tokens kept); it is re-prefilled."""
        self._free_blocks(request)
        request.num_computed_tokens = 0
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
            request.status = RequestStatus.WAITING
            self.waiting.appendleft(request)

    def reset_all(self) -> int:
        """Reset every request that holds KV, keeping queue order; returns how many."""
        victims = [r for r in self.running if r.block_ids] + [r for r in self.waiting if r.block_ids]
        for request in reversed(victims):
            self.reset(request)
        return len(victims)

    def invalidate_stale_kv(self) -> int:
        """The backstop: reset requests holding blocks written before the last KV discard."""
        if self._checked_epoch == self.pool.epoch:
            return 0
        epoch = self.pool.epoch
        stale = [r for r in self.unfinished() if any(self.pool.blocks[b].epoch != epoch for b in r.block_ids)]
        for request in reversed(stale):
            self.reset(request)
        self._checked_epoch = epoch
        self.stats.kv_invalidated_resets += len(stale)
        return len(stale)

    # ---- scheduling ---------------------------------------------------------------------------
    def schedule(self, weight_version: int) -> list[tuple[Request, int]]:
        """Choose (request, number of new tokens) pairs for one model step within the budget."""
        self.invalidate_stale_kv()
        budget = self.config.max_num_batched_tokens
        scheduled: list[tuple[Request, int]] = []
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            n = self._num_new_tokens(request, budget)
            if n == 0:
                break
            while not self._allocate(request, n, weight_version):
                victim = self.running[-1]
                self._preempt(victim)
                preempted = True
                if victim is request:
                    break
            else:
                scheduled.append((request, n))
                budget -= n
                i += 1
        while not preempted and self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            if self.admission_cutoff is not None and request.arrival > self.admission_cutoff:
                break
            hit = 0 if request.block_ids else self._match_prefix(request, weight_version)
            n = self._num_new_tokens(request, budget)
            if n == 0 or not self._allocate(request, n, weight_version):
                self._free_blocks(request)
                request.num_computed_tokens = 0
                break
            if self.pool.enable_prefix_caching:
                request.num_cached_tokens += hit
                self.stats.prefix_cache_queried_tokens += request.num_tokens
                self.stats.prefix_cache_hit_tokens += hit
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled.append((request, n))
            budget -= n
        for request, n in scheduled:
            start = request.num_computed_tokens
            recomputed = max(0, min(start + n, request.max_computed_tokens) - start)
            self.stats.recomputed_tokens += recomputed
            request.num_recomputed_tokens += recomputed
        return scheduled

    def after_step(self, scheduled: list[tuple[Request, int]]) -> None:
        """Advance computed tokens and publish newly full blocks to the prefix cache."""
        for request, n in scheduled:
            request.num_computed_tokens += n
            request.max_computed_tokens = max(request.max_computed_tokens, request.num_computed_tokens)
            if self.pool.enable_prefix_caching:
                self._register_full_blocks(request)

    # ---- helpers ------------------------------------------------------------------------------
    def _num_new_tokens(self, request: Request, budget: int) -> int:
        remaining = request.num_tokens - request.num_computed_tokens
        if self.config.enable_chunked_prefill:
            return min(remaining, budget)
        return remaining if remaining <= budget else 0

    def _allocate(self, request: Request, n: int, weight_version: int) -> bool:
        needed = -(-(request.num_computed_tokens + n) // self.config.block_size) - len(request.block_ids)
        if needed > self.pool.num_free:
            return False
        for _ in range(max(0, needed)):
            request.block_ids.append(self.pool.allocate(weight_version))
        return True

    def _preempt(self, request: Request) -> None:
        self.stats.preemptions += 1
        self.reset(request)

    def _free_blocks(self, request: Request) -> None:
        # free the tail first so that it is evicted before the (more shareable) head
        for block_id in reversed(request.block_ids):
            self.pool.free(block_id)
        request.block_ids = []
        request.block_hashes = []

    def _match_prefix(self, request: Request, weight_version: int) -> int:
        """Take the cached blocks of the longest matching prefix; returns the tokens they cover."""
        if not self.pool.enable_prefix_caching:
            return 0
        size = self.config.block_size
        num_full = (request.num_tokens - 1) // size  # keep at least one token to compute
        parent = None
        for j in range(num_full):
            tokens = tuple(request.token_ids[j * size : (j + 1) * size])
            block_hash = chain_hash(parent, tokens, request.cache_salt, weight_version)
            block_id = self.pool.lookup(block_hash, tokens)
            if block_id is None:
                break
            self.pool.touch(block_id)
            request.block_ids.append(block_id)
            request.block_hashes.append(block_hash)
            parent = block_hash
        request.num_computed_tokens = len(request.block_ids) * size
        return request.num_computed_tokens

    def _register_full_blocks(self, request: Request) -> None:
        size = self.config.block_size
        while len(request.block_hashes) < request.num_computed_tokens // size:
            j = len(request.block_hashes)
            tokens = tuple(request.token_ids[j * size : (j + 1) * size])
            parent = request.block_hashes[-1] if request.block_hashes else None
            block = self.pool.blocks[request.block_ids[j]]
            block_hash = chain_hash(parent, tokens, request.cache_salt, block.weight_version)
            self.pool.register(block.block_id, block_hash, tokens)
            request.block_hashes.append(block_hash)
