"""Group ids: which rows of a batch answer the same prompt.

SkyRL passes `index`, one group id per row (the prompt's uid, repeated for its n samples). Any
hashable ids work here (str, int, a 1-D integer tensor, a NumPy array). Groups are listed in the order
of their first row.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

GroupIds = Sequence[Hashable] | torch.Tensor


def group_ids(index: GroupIds, batch_size: int) -> list[Hashable]:
    """`index` as a list of `batch_size` hashable ids; ValueError when its length differs."""
    ids = index.tolist() if isinstance(index, torch.Tensor) else list(index)
    if len(ids) != batch_size:
        raise ValueError(f"index has {len(ids)} group ids for a batch of {batch_size} rows: give one per row")
    return ids


def group_rows(index: GroupIds, batch_size: int, device: torch.device | str = "cpu") -> list[torch.Tensor]:
    """The row numbers of each group (a LongTensor each), groups in order of their first row."""
    rows: dict[Hashable, list[int]] = {}
    for row, gid in enumerate(group_ids(index, batch_size)):
        rows.setdefault(gid, []).append(row)
    return [torch.tensor(r, dtype=torch.long, device=device) for r in rows.values()]


def prompt_boundaries(index: GroupIds) -> list[tuple[int, int]]:
    """(start, end) row slices of consecutive equal ids, one per prompt (SkyRL's
    `compute_prompt_boundaries`, what `loss_reduction=prompt_mean` averages over).

    ValueError when a prompt's rows are not contiguous."""
    ids = group_ids(index, len(index))
    bounds: list[tuple[int, int]] = []
    seen: set[Hashable] = set()
    start = 0
    for row in range(1, len(ids)):
        if ids[row] != ids[row - 1]:
            if ids[row] in seen:
                raise ValueError(
                    f"group id {ids[row]!r} appears again at row {row} after other groups: the rows of a "
                    "prompt must be contiguous (order the batch by prompt)"
                )
            seen.add(ids[row - 1])
            bounds.append((start, row))
            start = row
    if ids:
        bounds.append((start, len(ids)))
    return bounds


def episode_rows(episodes: GroupIds) -> tuple[list[int], list[int]]:
    """Step-wise trajectories (one row per turn, SkyRL's `is_last_step`): the last row of each
    episode, episodes in order, and each row's episode as an index into that list. `episodes` gives
    each row's episode id; an episode's rows must be consecutive (its last turn last).

    ValueError when an episode's rows are not consecutive."""
    ids = group_ids(episodes, len(episodes))
    last: list[int] = []
    owner: list[int] = []
    seen: set[Hashable] = set()
    for row, eid in enumerate(ids):
        if row == 0 or eid != ids[row - 1]:
            if eid in seen:
                raise ValueError(f"episode {eid!r} appears again at row {row} after other episodes: the rows "
                                 "of an episode (its turns) must be consecutive")
            seen.add(eid)
            last.append(row)
        last[-1] = row
        owner.append(len(last) - 1)
    return last, owner


def zero_variance_filter(
    rewards: Sequence[float] | torch.Tensor,
    index: GroupIds,
    loss_masks: Sequence[Sequence[float]] | torch.Tensor | None = None,
    tol: float = 0.0,
) -> list[int]:
    """The rows to keep under `trainer.algorithm.zero_variance_filter` (SkyRL's `zero_variance_filter`).

    A row is live when its loss mask has any nonzero entry (all rows when `loss_masks` is None). A group
    is dropped when it has more than one live row and max - min of their rewards <= `tol`
    (`zero_variance_filter_tol`); every row of a dropped group goes, live or not. Groups with at most one
    live row are kept. SkyRL applies this to response-level rewards before advantages and zeroes the
    loss masks of the rows not kept."""
    values = rewards.tolist() if isinstance(rewards, torch.Tensor) else list(rewards)
    ids = group_ids(index, len(values))
    if loss_masks is None:
        live = [True] * len(values)
    else:
        masks = loss_masks.tolist() if isinstance(loss_masks, torch.Tensor) else loss_masks
        if len(masks) != len(values):
            raise ValueError(f"loss_masks has {len(masks)} rows for {len(values)} rewards")
        live = [sum(m) > 0 for m in masks]
    live_rewards: dict[Hashable, list[float]] = {}
    for gid, reward, is_live in zip(ids, values, live, strict=True):
        if is_live:
            live_rewards.setdefault(gid, []).append(reward)
    dropped = {gid for gid, vals in live_rewards.items() if len(vals) > 1 and max(vals) - min(vals) <= tol}
    return [row for row, gid in enumerate(ids) if gid not in dropped]
