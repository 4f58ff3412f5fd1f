"""TrainBatch: the token-level tensors one training step consumes, and how its rows are cut into
micro-batches that pay for little padding."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any, ClassVar

import torch

from inflight.train.shared_prefix import packed_length


@dataclass
class TrainBatch:
    """Sequences of one rank's share of a training step, every tensor aligned with `input_ids`.

    - `input_ids` [B, T]: prompt + response tokens (right-padded).
    - `loss_mask` [B, T]: 1 where the token's log-probability counts in the loss (response tokens);
      position 0 is never predicted and must be 0.
    - `attention_mask` [B, T]: 1 for real tokens (default: all ones).
    - `advantages` [B] or [B, T]: per-sequence or per-token advantages (policy-gradient losses).
    - `old_logprobs` [B, T]: log-probabilities under the policy that sampled the tokens (the
      engine's `logprobs`), for the PPO ratio; absent means on-policy (ratio 1).
    - `routed_experts` [B, T, MoE layers, top_k] int16: the rollout's routing of each position
      (-1: none), which a mixture-of-experts worker with routing replay uses instead of its
      routers' choice (`inflight.train.routing_rows`, `inflight.train.moe_replay`).
    - `pixel_values` [B, P, D] float and `image_grid_thw` [B, N, 3] int64: each row's images for a
      vision-language policy, as the image processor gives them (`MultimodalInput`), padded: row b's
      images are its first grids up to the first (0, 0, 0) one, their patches its first rows of
      `pixel_values` (`image_rows`; `images` puts a micro-batch's back together).
    """

    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    attention_mask: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    old_logprobs: torch.Tensor | None = None
    routed_experts: torch.Tensor | None = None
    pixel_values: torch.Tensor | None = None
    image_grid_thw: torch.Tensor | None = None

    IMAGE_FIELDS: ClassVar[tuple[str, ...]] = ("pixel_values", "image_grid_thw")
    """Per-row fields whose second dimension counts patches and images, not token positions."""

    def __post_init__(self) -> None:
        if self.input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, seq], got shape {tuple(self.input_ids.shape)}")
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None and value.shape[0] != self.input_ids.shape[0]:
                raise ValueError(
                    f"{f.name} has {value.shape[0]} rows, input_ids has {self.input_ids.shape[0]}"
                )

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def split(self, size: int) -> list[TrainBatch]:
        """Micro-batches of at most `size` sequences, in order."""
        return [self.select(slice(i, i + size)) for i in range(0, len(self), size)]

    def select(self, rows: slice | torch.Tensor) -> TrainBatch:
        """The rows `rows` (a slice, or a tensor of row indices) of every tensor."""
        return self._map(lambda v: v[rows])

    def to(self, device: torch.device | str) -> TrainBatch:
        return self._map(lambda v: v.to(device))

    def _map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> TrainBatch:
        """The batch with `fn` applied to every tensor it holds (subclasses' fields too)."""
        return replace(
            self, **{f.name: fn(v) for f in fields(self) if (v := getattr(self, f.name)) is not None}
        )

    def widths(self) -> torch.Tensor:
        """[B] each row's length up to and including its last real token (right padding excluded)."""
        width = self.input_ids.shape[1]
        if self.attention_mask is None:
            return torch.full((len(self),), width, dtype=torch.long)
        columns = torch.arange(1, width + 1, device=self.attention_mask.device)
        return (self.attention_mask.ne(0) * columns).amax(dim=1).cpu()

    def trimmed(self) -> TrainBatch:
        """The batch cut to its longest row: the trailing columns that are padding in every row
        dropped from every [B, T] tensor. Right padding never changes the real tokens' outputs
        (causal attention), so the losses and their gradients are unchanged."""
        width = self.input_ids.shape[1]
        keep = max(int(self.widths().max()), 1) if len(self) else width
        if keep >= width:
            return self
        per_token = {f.name: v for f in fields(self) if (v := getattr(self, f.name)) is not None
                     and f.name not in self.IMAGE_FIELDS and v.dim() >= 2 and v.shape[1] == width}
        return replace(self, **{name: v[:, :keep] for name, v in per_token.items()})

    def images(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(pixel_values [patches, D], image_grid_thw [images, 3]) of every row's images, row after
        row: what a Hugging Face vision-language model's forward takes for these rows (their
        placeholder tokens are in the same order); None when no row has an image."""
        if self.image_grid_thw is None:
            return None
        grids = self.image_grid_thw.long()
        patches = grids.prod(dim=-1)  # a padding grid (0, 0, 0) has none
        if not bool(patches.any()):
            return None
        counts = patches.sum(dim=1).tolist()
        pixels = torch.cat([self.pixel_values[row, :count] for row, count in enumerate(counts)])
        return pixels, grids[patches > 0]


def image_rows(images: Sequence[Any]) -> dict[str, torch.Tensor]:
    """`TrainBatch`'s `pixel_values` and `image_grid_thw` for rows whose images are `images` (one
    per row: a `MultimodalInput` with `pixel_values` [patches, D] and `image_grid_thw` [n, 3], or
    None for a row without images), zero-padded to the row with the most; {} when no row has one."""
    present = [m for m in images if m is not None and len(m.image_grid_thw)]
    if not present:
        return {}
    dims = {m.pixel_values.shape[1] for m in present}
    if len(dims) > 1:
        raise ValueError(f"images of different patch sizes in one batch ({sorted(dims)} values per patch): "
                         "every trajectory must come from the same model's image processor")
    rows, patches = len(images), max(m.pixel_values.shape[0] for m in present)
    pixel_values = torch.zeros((rows, patches, dims.pop()), dtype=present[0].pixel_values.dtype)
    grids = torch.zeros((rows, max(len(m.image_grid_thw) for m in present), 3), dtype=torch.long)
    for row, m in enumerate(images):
        if m is not None and len(m.image_grid_thw):
            pixel_values[row, : m.pixel_values.shape[0]] = torch.as_tensor(m.pixel_values)
            grids[row, : len(m.image_grid_thw)] = torch.as_tensor(m.image_grid_thw, dtype=torch.long)
    return {"pixel_values": pixel_values, "image_grid_thw": grids}


def plan_micro_batches(lengths: Sequence[int], max_rows: int, max_tokens: int | None = None,
                       pass_cost: float = 0.0) -> list[list[int]]:
    """Micro-batches (lists of indices into `lengths`) of rows sorted longest first, each padded
    only to its own longest row: at most `max_rows` rows and `max_tokens` padded tokens (rows x
    longest; a longer row runs alone), cut where the padded tokens plus `pass_cost` per micro-batch
    are fewest (ties: fewer micro-batches). `pass_cost=math.inf`: the fewest micro-batches."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    if not order:
        return []
    width = torch.tensor([lengths[i] for i in order], dtype=torch.float64)
    cuts = _best_cuts(width, max_rows, max_tokens, pass_cost)
    parts, stop = [], len(order)
    while stop > 0:
        parts.append(order[cuts[stop] : stop])
        stop = cuts[stop]
    return parts[::-1]


def plan_shared_micro_batches(
    lengths: Sequence[int],
    groups: Sequence[int],
    contexts: Sequence[int],
    max_rows: int,
    max_tokens: int | None = None,
    pass_cost: float = 0.0,
) -> list[list[int]]:
    """`plan_micro_batches` for the shared-prefix forward (`inflight.train.shared_prefix`): micro-
    batches of whole groups (rows with equal `groups`; a group of more than `max_rows` rows in runs
    of `max_rows`), each group costing one packed row of its context (`contexts`) and every row's
    tokens after it; at most `max_rows` rows and `max_tokens` padded packed tokens each, cut where
    the padded packed tokens plus `pass_cost` per micro-batch are fewest."""
    members: dict[int, list[int]] = {}
    for i, group in enumerate(groups):
        members.setdefault(group, []).append(i)
    units = [rows[at : at + max_rows] for rows in members.values() for at in range(0, len(rows), max_rows)]
    if not units:
        return []
    packed = [packed_length(contexts[u[0]], (lengths[i] for i in u)) for u in units]
    order = sorted(range(len(units)), key=lambda u: (-packed[u], units[u][0]))
    width = torch.tensor([packed[u] for u in order], dtype=torch.float64)
    counts = torch.tensor([len(units[u]) for u in order], dtype=torch.float64)
    cuts = _best_cuts(width, max_rows, max_tokens, pass_cost, counts)
    parts, stop = [], len(order)
    while stop > 0:
        parts.append([i for u in order[cuts[stop] : stop] for i in units[u]])
        stop = cuts[stop]
    return parts[::-1]


def _best_cuts(width: torch.Tensor, max_rows: int, max_tokens: int | None, pass_cost: float,
               counts: torch.Tensor | None = None) -> list[int]:
    """cuts[j]: where the last micro-batch of the best plan of the first j units (`width` sorted
    longest first; each holding `counts` rows, default one) starts. Dynamic programming over the
    last cut, one vector op per unit."""
    n = len(width)
    # an infinite pass cost means: fewest passes first, then fewest padded tokens
    per_pass = float(n * width.max() + 1) if math.isinf(pass_cost) else pass_cost + 1e-6
    held = torch.zeros(n + 1, dtype=torch.float64)
    held[1:] = torch.ones(n, dtype=torch.float64).cumsum(0) if counts is None else counts.cumsum(0)
    best = torch.zeros(n + 1, dtype=torch.float64)
    cuts = [0] * (n + 1)
    for stop in range(1, n + 1):
        # the earliest start whose units hold at most max_rows rows (one unit always fits)
        start = min(int(torch.searchsorted(held, held[stop] - max_rows)), stop - 1)
        units = stop - torch.arange(start, stop, dtype=torch.float64)
        cost = best[start:stop] + per_pass + units * width[start:stop]
        if max_tokens is not None:
            cost[(units * width[start:stop] > max_tokens) & (units > 1)] = math.inf
        # the latest of equal starts: the fuller micro-batches come first
        last = len(cost) - 1 - int(torch.argmin(cost.flip(0)))
        best[stop], cuts[stop] = cost[last], start + last
    return cuts
