"""Counters the engine keeps (exposed as `engine.stats`, and on the server's /metrics)."""

from dataclasses import asdict, dataclass

from inflight.engine.scheduler import SchedulerOutput


@dataclass
class EngineStats:
    """The engine's counters since it started (`LLMEngine.stats`): steps, tokens, prefix-cache hits,
    preemptions, resets (asked for, and by the KV-epoch backstop), pauses and weight updates."""

    steps: int = 0
    prompt_tokens_computed: int = 0  # prefill tokens run through the model (first time)
    generated_tokens: int = 0
    prefix_cache_queried_tokens: int = 0
    prefix_cache_hit_tokens: int = 0
    preemptions: int = 0
    resets: int = 0  # requests reset on request (reset_prefix_cache(reset_running_requests=True))
    kv_invalidated_resets: int = 0  # requests reset by the backstop: they held discarded KV
    recomputed_tokens: int = 0
    finished_requests: int = 0
    aborted_requests: int = 0
    pauses: int = 0
    weight_updates: int = 0
    failed_weight_updates: int = 0
    expired_weight_updates: int = 0  # abandoned by the lease (weight_update_timeout_s)

    def book(self, out: SchedulerOutput) -> None:
        """Add the counts of one schedule() call."""
        self.kv_invalidated_resets += out.kv_invalidated_resets
        self.preemptions += out.preemptions
        self.prefix_cache_queried_tokens += out.prefix_cache_queried_tokens
        self.prefix_cache_hit_tokens += out.prefix_cache_hit_tokens
        self.recomputed_tokens += out.recomputed_tokens

    def as_dict(self) -> dict[str, int]:
        """The counters as a plain dict (JSON-ready)."""
        return asdict(self)
