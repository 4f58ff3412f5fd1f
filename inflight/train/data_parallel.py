"""Data parallelism of the training step: which rows each data-parallel rank trains on.

Every rank receives the whole step (its groups are a few token lists) and derives the same global
view from it: advantages, the dropped groups, the mini-batches and each mini-batch's token count.
The groups of each mini-batch are then dealt round-robin to the data-parallel ranks. Every rank
runs the same number of forwards and backwards, whatever its share: a rank with fewer rows runs
zero-weight padding micro-batches, because FSDP (all-gather / reduce-scatter) and Megatron (the
gradient all-reduce) meet in collectives inside each of them. The loss of a micro-batch is scaled
by its share of the GLOBAL mini-batch count times the data-parallel size, so the gradient the
backends average over the ranks is the single-rank gradient of the whole mini-batch.

Micro-batches pay for little padding: a rank's rows of a mini-batch are sorted by length and cut
where padded tokens plus a per-pass cost are fewest (`inflight.train.batch.plan_micro_batches`),
each padded only to its own longest row. Every rank plans every rank's share (the lengths are the
step's, known to all), so they agree on the number of passes without a collective.

Ranks of one tensor-parallel group (Megatron) are one data-parallel rank: they get the same rows.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist

from inflight.train.batch import TrainBatch, plan_micro_batches, plan_shared_micro_batches


@dataclass(frozen=True)
class DataParallel:
    """A worker's data-parallel rank and size, and the group its ranks reduce metrics over
    (None: the default group)."""

    rank: int = 0
    size: int = 1
    group: Any = None
    device: torch.device = torch.device("cpu")


def data_parallel(worker: Any) -> DataParallel:
    """The worker's place among the data-parallel ranks (Megatron: its data-parallel group, the
    ranks of one tensor-parallel group share a place; FSDP: every rank is one)."""
    if getattr(worker, "world_size", 1) <= 1 or not dist.is_initialized():
        return DataParallel()
    device = worker.device if dist.get_backend() == "nccl" else torch.device("cpu")
    group = getattr(worker, "dp_group", None)
    if group is not None:
        return DataParallel(dist.get_rank(group), dist.get_world_size(group), group, device)
    tp = getattr(worker, "tp", 1)
    return DataParallel(worker.rank // tp, worker.world_size // tp, None, device)


@dataclass(frozen=True)
class MiniBatch:
    """One optimizer step's rows: `rows` in the step's batch (every rank's), `local` this rank's
    rows of it in the rank's batch, `micro_batches`, the forward/backward passes every rank runs
    for it (enough for the largest share), and `parts`, this rank's real ones (row indices into
    the rank's batch; the rest of the passes are padding)."""

    rows: slice
    local: slice
    micro_batches: int
    parts: tuple[tuple[int, ...], ...] = ()


@dataclass(frozen=True)
class Shard:
    """A rank's part of a step: its rows of the step's batch, mini-batch after mini-batch, and
    every rank's rows (`rank_rows`, step indices: what forward-only passes are planned over)."""

    rows: list[int]
    mini_batches: list[MiniBatch]
    rank_rows: tuple[tuple[int, ...], ...] = ()


@dataclass(frozen=True)
class RowGroups:
    """Each step row's group of rows with one context (`groups`) and that context's length."""

    groups: tuple[int, ...]
    contexts: tuple[int, ...]


@dataclass(frozen=True)
class MicroPlan:
    """How a rank's rows of a mini-batch are cut into micro-batches (see `plan_micro_batches`):
    at most `max_rows` rows and `max_tokens` padded tokens each, `pass_cost` padded tokens
    charged per pass."""

    max_rows: int
    max_tokens: int | None = None
    pass_cost: float = 0.0
    shared: RowGroups | None = None
    """The step's rows by shared context (`trainer.shared_prefix_forward`): micro-batches of whole
    groups (`plan_shared_micro_batches`)."""

    def cut(self, lengths: Sequence[int], rows: Sequence[int] | None = None) -> list[list[int]]:
        """Micro-batches of the rows of `lengths` (indices into it); `rows`: their step rows, which
        `shared` is indexed by."""
        if self.shared is None or rows is None:
            return plan_micro_batches(lengths, self.max_rows, self.max_tokens, self.pass_cost)
        return plan_shared_micro_batches(
            lengths,
            [self.shared.groups[r] for r in rows],
            [self.shared.contexts[r] for r in rows],
            self.max_rows,
            self.max_tokens,
            self.pass_cost,
        )


def shard_step(num_groups: int, group_size: int | Sequence[int], groups_per_mini: int, micro: int | MicroPlan,
               dp: DataParallel, lengths: Sequence[int] | None = None,
               live: Sequence[bool] | None = None) -> Shard:
    """Mini-batches of `groups_per_mini` consecutive groups (of `group_size` rows each, or each its
    own number of rows: step-wise trajectories); the groups of each one dealt round-robin to the
    `dp.size` ranks; each rank's share cut into micro-batches of at most `micro` rows (or as a
    `MicroPlan` says) by the rows' `lengths` (default: all equal). Rows that are not `live` (nothing
    to train on: an all-zero loss mask) stay in the rank's rows but in none of its micro-batches."""
    plan = micro if isinstance(micro, MicroPlan) else MicroPlan(micro, pass_cost=math.inf)
    sizes = [group_size] * num_groups if isinstance(group_size, int) else list(group_size)
    first_rows = [0, *itertools.accumulate(sizes)]
    lengths = list(lengths) if lengths is not None else [1] * first_rows[-1]
    live = list(live) if live is not None else [True] * first_rows[-1]
    rows: list[int] = []
    every_rank: list[list[int]] = [[] for _ in range(dp.size)]
    minis: list[MiniBatch] = []
    for start in range(0, num_groups, groups_per_mini):
        stop = min(num_groups, start + groups_per_mini)
        shares = [
            [r for g in range(start + k, stop, dp.size) for r in range(first_rows[g], first_rows[g + 1])]
            for k in range(dp.size)
        ]
        for r, share in enumerate(shares):
            every_rank[r].extend(share)
        cuts = [_cut(plan, share, lengths, live) for share in shares]
        first = len(rows)
        rows.extend(shares[dp.rank])
        parts = tuple(tuple(first + i for i in part) for part in cuts[dp.rank])
        passes = max(1, *(len(c) for c in cuts))
        every = slice(first_rows[start], first_rows[stop])
        minis.append(MiniBatch(every, slice(first, len(rows)), passes, parts))
    return Shard(rows, minis, tuple(tuple(r) for r in every_rank))


def _cut(plan: MicroPlan, share: list[int], lengths: Sequence[int], live: Sequence[bool]) -> list[list[int]]:
    """`plan`'s micro-batches of a share's live rows, as positions in the share."""
    positions = [i for i, row in enumerate(share) if live[row]]
    rows = [share[i] for i in positions]
    return [[positions[j] for j in part] for part in plan.cut([lengths[r] for r in rows], rows)]


def forward_parts(shard: Shard, plan: MicroPlan, lengths: Sequence[int],
                  include: Sequence[bool] | None = None) -> tuple[list[tuple[int, ...]], int]:
    """Forward-only micro-batches over a rank's rows (those `include` keeps, default all) at once,
    cut as `plan` says: this rank's (indices into its batch, `local_batch`'s rows) and the number of
    passes every rank runs (the most any rank needs: the passes of FSDP and Megatron are collectives)."""
    keep = [True] * len(lengths) if include is None else include
    where = {row: i for i, row in enumerate(shard.rows)}
    kept = [[row for row in rows if keep[row]] for rows in shard.rank_rows]
    cuts = [plan.cut([lengths[row] for row in rows], rows) for rows in kept]
    mine_rows = [row for row in shard.rows if keep[row]]
    mine = [
        tuple(where[mine_rows[j]] for j in part)
        for part in plan.cut([lengths[r] for r in mine_rows], mine_rows)
    ]
    return mine, max(1, *(len(c) for c in cuts)) if cuts else 1


def padding(batch: TrainBatch) -> TrainBatch:
    """A one-row micro-batch that counts nothing (zero loss mask): what a rank whose share has run
    out forwards and backwards, with weight 0, to take part in the other ranks' collectives. The
    batch's shortest row, trimmed: the cheapest pass."""
    row = batch.select(batch.widths().argmin().reshape(1).to(batch.input_ids.device)).trimmed()
    advantages = None if row.advantages is None else torch.zeros_like(row.advantages)
    return replace(row, loss_mask=torch.zeros_like(row.loss_mask), advantages=advantages)


def local_batch(batch: TrainBatch, shard: Shard) -> TrainBatch:
    """The rank's rows of the step's batch, or one padding row when it has none (its proximal and
    reference forwards still run: they are collectives too)."""
    if not shard.rows:
        return padding(batch)
    return batch.select(torch.tensor(shard.rows, dtype=torch.long))


def micro_batches(batch: TrainBatch, mini: MiniBatch) -> list[tuple[TrainBatch, torch.Tensor | None]]:
    """The rank's micro-batches of `mini`, each trimmed to its longest row, and padding passes up
    to `mini.micro_batches`; each with its row indices in `batch` (None: padding)."""
    return passes(batch, mini.parts, mini.micro_batches)


def passes(
    batch: TrainBatch, parts: Sequence[Sequence[int]], count: int
) -> list[tuple[TrainBatch, torch.Tensor | None]]:
    """The micro-batches `parts` (row indices into `batch`), each trimmed to its longest row, then
    padding up to `count` passes; each with its row indices in `batch` (None: padding)."""
    out: list[tuple[TrainBatch, torch.Tensor | None]] = []
    for part in parts:
        rows = torch.tensor(part, dtype=torch.long, device=batch.input_ids.device)
        out.append((batch.select(rows).trimmed(), rows))
    return out + [(padding(batch), None)] * (count - len(out))


def gather_rows(local: torch.Tensor, shard: Shard, num_rows: int, dp: DataParallel) -> torch.Tensor:
    """[num_rows, T]: every rank's rows of a per-row tensor (`local`, the rank's rows in `shard.rows`
    order) put at their place in the step's batch (a sum over the ranks: their rows are disjoint;
    a collective over `dp.group` when `dp.size > 1`)."""
    out = torch.zeros((num_rows, *local.shape[1:]), dtype=local.dtype, device=local.device)
    if shard.rows:
        out[torch.tensor(shard.rows, dtype=torch.long, device=local.device)] = local[: len(shard.rows)]
    if dp.size > 1:
        moved = out.to(dp.device)
        dist.all_reduce(moved, op=dist.ReduceOp.SUM, group=dp.group)
        out = moved.to(local.device)
    return out


class StepStats:
    """A step's loss statistics: weighted sums (a mean over the step once every rank's are added)
    and extremes (keys ending in `_max` / `_min`). Until `reduced`, a rank holds its part only."""

    def __init__(self, sums: dict[str, float] | None = None,
                 extremes: dict[str, float] | None = None) -> None:
        self.sums = dict(sums or {})
        self.extremes = dict(extremes or {})

    def add(self, stats: dict[str, float], weight: float) -> None:
        for key, value in stats.items():
            if key.endswith("_max"):
                self.extremes[key] = max(self.extremes.get(key, value), value)
            elif key.endswith("_min"):
                self.extremes[key] = min(self.extremes.get(key, value), value)
            else:
                self.sums[key] = self.sums.get(key, 0.0) + value * weight

    def copy(self) -> StepStats:
        return StepStats(self.sums, self.extremes)

    def reduced(self, dp: DataParallel, keys: tuple[str, ...] | None = None) -> StepStats:
        """Every rank's `keys` (default: every key any rank has) combined (sums added, extremes
        taken; a key no rank has stays absent); other keys stay this rank's. A collective over
        `dp.group` when `dp.size > 1`."""
        if dp.size == 1:
            return self.copy()
        if keys is None:
            names: list[list[str]] = [[] for _ in range(dp.size)]
            dist.all_gather_object(names, sorted({*self.sums, *self.extremes}), group=dp.group)
            keys = tuple(sorted({k for ks in names for k in ks}))
        sums = [k for k in keys if not k.endswith(("_max", "_min"))]
        tops = [k for k in keys if k.endswith("_max")]
        lows = [k for k in keys if k.endswith("_min")]
        added = torch.tensor([[self.sums.get(k, 0.0), float(k in self.sums)] for k in sums],
                             dtype=torch.float64)
        peaks = torch.tensor(
            [self.extremes.get(k, -math.inf) for k in tops] + [-self.extremes.get(k, math.inf) for k in lows],
            dtype=torch.float64,
        )
        added, peaks = added.to(dp.device), peaks.to(dp.device)
        dist.all_reduce(added, op=dist.ReduceOp.SUM, group=dp.group)
        dist.all_reduce(peaks, op=dist.ReduceOp.MAX, group=dp.group)
        out = StepStats({k: v for k, v in self.sums.items() if k not in keys},
                        {k: v for k, v in self.extremes.items() if k not in keys})
        out.sums |= {k: float(v) for k, (v, has) in zip(sums, added.tolist(), strict=True) if has}
        values = peaks.tolist()
        out.extremes |= {k: v for k, v in zip(tops, values[: len(tops)], strict=True) if v != -math.inf}
        out.extremes |= {k: -v for k, v in zip(lows, values[len(tops) :], strict=True) if v != -math.inf}
        return out
