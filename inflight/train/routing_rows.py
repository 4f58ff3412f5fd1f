"""The rollout's routing records as a batch tensor aligned with the input positions.

A trajectory's record (`Trajectory.routed_experts`, from the engine's `RequestOutput.routed_experts`
of its last turn, asked with `return_routed_experts=True`) holds, for positions
`routed_experts_start ...` of prompt + response, the experts each MoE layer chose. In the batch
(`TrainBatch.routed_experts`) row b, position t holds the record of that position of trajectory b,
or -1 where there is none: padding, the row's last position (its hidden state only predicts past
the end), positions the record does not reach (tokens appended after the last turn) and rows
without a record. int16: every expert id of a record fits (`inflight.engine.models.moe.routing_dtype`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

NO_RECORD = -1
"""`TrainBatch.routed_experts` where a position has no record: the router chooses."""


def routing_rows(trajectories: Sequence[Any], width: int) -> torch.Tensor | None:
    """[B, width, MoE layers, top_k] int16 of the trajectories' records (NO_RECORD elsewhere); None
    when none of them has one. ValueError when records of different shapes are mixed."""
    records = [t.routed_experts for t in trajectories if getattr(t, "routed_experts", None) is not None]
    if not records:
        return None
    shape = records[0].shape[1:]
    if any(r.ndim != 3 or r.shape[1:] != shape for r in records):
        raise ValueError(
            f"routing records of different shapes in one batch: {sorted({r.shape[1:] for r in records})}"
            " (every trajectory must come from the same model)"
        )
    out = torch.full((len(trajectories), width, *shape), NO_RECORD, dtype=torch.int16)
    for row, t in enumerate(trajectories):
        record = getattr(t, "routed_experts", None)
        if record is None:
            continue
        start = t.routed_experts_start
        stop = min(start + len(record), len(t.prompt_ids) + len(t.response_ids) - 1, width)
        if stop > start:
            out[row, start:stop] = torch.from_numpy(np.asarray(record[: stop - start]).astype(np.int16))
    return out


__all__ = ["NO_RECORD", "routing_rows"]
