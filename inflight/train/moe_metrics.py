"""The training step's mixture-of-experts metrics: how the trainer's routing compares with the rollout's.

From the training forwards themselves (`routing_metrics`, every step, at no extra cost: the router
hooks of `inflight.train.moe_replay` count while they run): over the positions with a routing
record in rows with tokens to train on, the fraction whose experts differ from the rollout's in
some MoE layer, as the forward used them (`moe/routing_mismatch`: 0 with routing replay, by
construction) and as the trainer's router would choose them (`moe/router_disagreement`: what
replay corrects; it grows as the policy moves away from the weights that generated).

Every `trainer.moe_logprob_gap_interval` steps (`logprob_gaps`, before the optimizer steps, on the
weights the step starts from): two forwards without gradients over the rank's rows, with and
without replay, give the mean |trainer - rollout| log-probability of the trained tokens
(`moe/logprob_gap_replay`, `moe/logprob_gap_no_replay`): what replay buys, in the quantity the
off-policy correction works on. Both are reduced over the data-parallel ranks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from inflight.train.data_parallel import Shard, StepStats, forward_parts, passes


def routing_metrics(step: Any) -> dict[str, float]:
    """The step's routing counts as fractions (empty when the policy is dense or no record came)."""
    routing = getattr(step.worker, "routing", None)
    if routing is None:
        return {}
    counts = StepStats({f"moe/{k}": float(v) for k, v in routing.take_counts().items()}).reduced(step.dp).sums
    tokens = counts.get("moe/tokens", 0.0)
    if tokens == 0:
        return {}
    return {"moe/routing_mismatch": counts["moe/used_differs"] / tokens,
            "moe/router_disagreement": counts["moe/router_differs"] / tokens, "moe/routed_tokens": tokens}


def logprob_gaps(step: Any, batch: Any, local: Any, shard: Shard, live: Sequence[bool]) -> dict[str, float]:
    """Every `trainer.moe_logprob_gap_interval` steps: the trained tokens' mean |log-probability -
    rollout's| with and without routing replay (empty otherwise, or without records)."""
    worker, interval = step.worker, step.cfg.trainer.moe_logprob_gap_interval
    routing = getattr(worker, "routing", None)
    if routing is None or local.routed_experts is None or interval <= 0 or worker.global_step % interval:
        return {}
    parts, count = forward_parts(shard, step.forward_plan(), batch.widths().tolist(), live)
    sums = dict.fromkeys(("moe/gap_tokens", "moe/gap_replay", "moe/gap_no_replay"), 0.0)
    for name, on in (("replay", True), ("no_replay", False)):
        with routing.replaying(on):
            for part, rows in passes(local, parts, count):  # every rank runs `count`: FSDP's are collectives
                logprobs = worker.logprobs(part)
                if rows is None:
                    continue
                mask = part.loss_mask.to(logprobs)
                sums[f"moe/gap_{name}"] += float(
                    ((logprobs - part.rollout_logprobs.to(logprobs)).abs() * mask).sum()
                )
                sums["moe/gap_tokens"] += float(mask.sum()) if on else 0.0
    reduced = StepStats(sums).reduced(step.dp).sums
    tokens = max(reduced["moe/gap_tokens"], 1.0)
    return {
        f"moe/logprob_gap_{name}": reduced[f"moe/gap_{name}"] / tokens for name in ("replay", "no_replay")
    }


__all__ = ["logprob_gaps", "routing_metrics"]
