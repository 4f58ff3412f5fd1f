"""The rollout's routing records in the training batch: aligned with the input positions
(`inflight.train.routing_rows`), and still aligned in every micro-batch of every data-parallel
rank's share (`inflight.train.data_parallel`), padding passes included."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from inflight.rollout.trajectory import Trajectory, TrajectoryGroup
from inflight.tasks.base import Problem
from inflight.train.data_parallel import DataParallel, MicroPlan, local_batch, micro_batches, shard_step
from inflight.train.routing_rows import NO_RECORD, routing_rows
from inflight.train.step import build_batch

LAYERS, TOP_K = 3, 2


def _traj(prompt: int, response: int, start: int = 0, rows: int | None = None, seed: int = 0) -> Trajectory:
    """A trajectory with a random record of `rows` rows (default: every position but the last) from
    `start`."""
    rng = np.random.default_rng(seed)
    n = prompt + response
    rows = n - 1 - start if rows is None else rows
    record = rng.integers(0, 8, size=(rows, LAYERS, TOP_K)).astype(np.uint8)
    return Trajectory(
        list(rng.integers(3, 50, prompt)), list(rng.integers(3, 50, response)), [-0.5] * response,
        [0] * response, [1] * response, float(seed % 2), "stop", routed_experts=record,
        routed_experts_start=start,
    )


def test_rows_sit_at_their_positions_and_the_rest_is_no_record():
    full = _traj(4, 5, seed=1)
    from_last_prompt = _traj(4, 5, start=3, seed=2)  # the engine's record without return_routed_experts
    longer = _traj(4, 5, rows=12, seed=3)  # a turn cut at a stop string: its record runs past the end
    shorter = _traj(4, 5, rows=5, seed=4)  # tokens appended after the last turn: no record there
    bare = Trajectory([5, 6], [7], [-1.0], [0], [1], 0.0, "stop")
    rows = routing_rows([full, from_last_prompt, longer, shorter, bare], width=11)
    assert rows.shape == (5, 11, LAYERS, TOP_K) and rows.dtype == torch.int16
    assert torch.equal(rows[0, :8], torch.from_numpy(full.routed_experts.astype(np.int16)))
    assert torch.equal(rows[1, 3:8], torch.from_numpy(from_last_prompt.routed_experts.astype(np.int16)))
    assert torch.equal(rows[2, :8], torch.from_numpy(longer.routed_experts[:8].astype(np.int16)))
    assert torch.equal(rows[3, :5], torch.from_numpy(shorter.routed_experts.astype(np.int16)))
    has = (rows[..., 0, 0] != NO_RECORD).sum(1).tolist()
    assert has == [8, 5, 8, 5, 0]  # never the last position (8), the padding or a row without a record
    assert (rows[(rows[..., 0, 0] == NO_RECORD)] == NO_RECORD).all()
    assert routing_rows([bare], 3) is None
    mixed = _traj(3, 2)
    mixed.routed_experts = mixed.routed_experts[:, :2]
    with pytest.raises(ValueError, match="routing records of different shapes"):
        routing_rows([full, mixed], 11)


@pytest.mark.parametrize("dp_size", [1, 2])
def test_every_micro_batch_of_every_rank_carries_its_rows_records(dp_size):
    """Six groups of two, two mini-batches, rows of many lengths: each micro-batch a rank runs holds,
    for each of its rows, exactly that trajectory's record over the micro-batch's (trimmed) width."""
    groups = [TrajectoryGroup(Problem(f"p{g}", "", ""), [_traj(3 + g, 2 + 3 * s + g % 3, seed=10 * g + s)
                                                        for s in range(2)]) for g in range(6)]
    trajs = [t for g in groups for t in g.trajectories]
    batch = build_batch(groups, None, pad_id=0)
    full = routing_rows(trajs, batch.input_ids.shape[1])
    assert torch.equal(batch.routed_experts, full)
    widths = batch.widths().tolist()
    seen = []
    for rank in range(dp_size):
        shard = shard_step(6, 2, 3, MicroPlan(3, pass_cost=0.0), DataParallel(rank, dp_size), widths)
        local = local_batch(batch, shard)
        for mini in shard.mini_batches:
            for part, rows in micro_batches(local, mini):
                width = part.input_ids.shape[1]
                assert part.routed_experts.shape[:2] == (len(part), width)
                if rows is None:
                    continue
                for i, row in enumerate(rows.tolist()):
                    step_row = shard.rows[row]
                    seen.append(step_row)
                    assert torch.equal(part.input_ids[i], batch.input_ids[step_row, :width])
                    assert torch.equal(part.routed_experts[i], full[step_row, :width])
    assert sorted(seen) == list(range(12))
