"""The shared-prefix forward (`trainer.shared_prefix_forward`): the rows of a micro-batch that begin
with the same context (a GRPO group: one prompt, `n_samples_per_prompt` responses) run as one
sequence, the context once and every response after it.

A group's packed row is its context (the tokens before the first trained one, equal in every row of
the group) followed by each row's own tokens, one row after the other. Position ids restart at the
context's length for every row, and the attention mask is a tree: a context token sees the context
before it, a row's token sees the whole context and its own row up to itself. Each token's hidden
state is then the one the row alone would give (the same attention inputs, the same positions), so
the log-probabilities and their gradients equal the plain forward's up to float rounding, while the
context's tokens run once per group instead of once per row. The LM head runs once per distinct
prediction: the context's predictions once per group, each row's own after that.

It pays where contexts are long against the responses and groups are large (the demo: a 9-token
prompt, 8 responses of ~4 tokens: 2.6x fewer tokens). The packed row is longer, and its attention
(the mask leaves no kernel a causal shortcut) grows with its square, so `pack` packs a micro-batch
only where `cost` says that the tokens saved outweigh it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PackedRows:
    """A micro-batch packed by shared context.

    - `input_ids`, `position_ids` [G, L]: one row per group of rows with the same context.
    - `attention_mask` [G, 1, L, L] bool: True where a query position (dim 2) sees a key (dim 3).
    - `states` [N]: flat indices (g * L + position) of the hidden states that predict something,
      one per distinct prediction; `targets` [N]: the token each predicts.
    - `pick` [B, T]: which of the N predictions is row b's log-probability of its token t (-1: none,
      position 0 and right padding).
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    attention_mask: torch.Tensor
    states: torch.Tensor
    targets: torch.Tensor
    pick: torch.Tensor

    def unpack(self, flat: torch.Tensor) -> torch.Tensor:
        """[B, T] from one value per prediction [N] (0 where `pick` is -1)."""
        padded = torch.cat([flat.new_zeros(1), flat])
        return padded[self.pick + 1]


def context_lengths(loss_mask: torch.Tensor, widths: torch.Tensor) -> list[int]:
    """Each row's context: the tokens before its first trained one (a row with none: all of it)."""
    trained = loss_mask.ne(0)
    first = trained.int().argmax(dim=1)
    return torch.where(trained.any(dim=1), first, widths.to(first.device)).tolist()


def packed_length(context: int, lengths: Iterable[int]) -> int:
    """The packed row of a group: its context once, then each row's tokens after the context."""
    return context + sum(n - context for n in lengths)


def cost(rows: int, width: int, pair_cost: float) -> float:
    """A forward over `rows` x `width` tokens, in tokens: each token plus `pair_cost` per attended
    (query, key) pair (every pair: a custom mask gets no causal shortcut)."""
    return rows * width * (1.0 + pair_cost * width)


def pack(
    input_ids: torch.Tensor, loss_mask: torch.Tensor, widths: torch.Tensor, pair_cost: float
) -> PackedRows | None:
    """The micro-batch packed by shared context, or None where packing would not pay (`cost`).
    `widths` [B]: each row's length (`TrainBatch.widths`)."""
    lengths = widths.tolist()
    contexts = context_lengths(loss_mask.cpu(), widths)
    ids = input_ids.cpu()
    groups: dict[tuple[int, ...], list[int]] = {}
    for row, (ctx, n) in enumerate(zip(contexts, lengths, strict=True)):
        if n > 0:
            groups.setdefault(tuple(ids[row, :ctx].tolist()), []).append(row)
    packed = [packed_length(len(key), (lengths[r] for r in members)) for key, members in groups.items()]
    longest = max(packed, default=0)
    if not groups or cost(len(groups), longest, pair_cost) >= cost(len(lengths), max(lengths), pair_cost):
        return None
    return _build(ids, lengths, list(groups.items()), longest, input_ids.device)


def _build(ids: torch.Tensor, lengths: list[int], groups: list[tuple[tuple[int, ...], list[int]]], width: int,
           device: torch.device) -> PackedRows:
    """Each group's packed row (its context, then each member row's own tokens), the positions,
    segments and the distinct predictions with where every row's log-probabilities come from."""
    num = len(groups)
    packed_ids = torch.zeros(num, width, dtype=torch.long)
    positions = torch.zeros(num, width, dtype=torch.long)
    segment = torch.full((num, width), -1, dtype=torch.long)  # `tree_mask`'s segments
    pick = torch.full(ids.shape, -1, dtype=torch.long)
    states: list[torch.Tensor] = []
    targets: list[torch.Tensor] = []
    count = 0
    for g, (key, members) in enumerate(groups):
        ctx, base = len(key), g * width
        packed_ids[g, :ctx] = ids[members[0], :ctx]
        positions[g, :ctx] = torch.arange(ctx)
        segment[g, :ctx] = 0
        start = ctx
        for i, row in enumerate(members):
            own = lengths[row] - ctx
            packed_ids[g, start : start + own] = ids[row, ctx : lengths[row]]
            positions[g, start : start + own] = torch.arange(ctx, lengths[row])
            segment[g, start : start + own] = i + 1
            # where row's position t is in the packed row: the context, then its own stretch
            where = torch.cat([torch.arange(ctx), torch.arange(start, start + own)]) + base
            # predictions of tokens 1..n-1 from positions 0..n-2; the context's are the group's first row's
            first = 1 if i == 0 else max(ctx, 1)
            new = torch.arange(first, lengths[row])
            states.append(where[new - 1])
            targets.append(ids[row, new])
            pick[row, new] = torch.arange(count, count + len(new))
            if i > 0 and ctx > 1:
                pick[row, 1:ctx] = pick[members[0], 1:ctx]
            count += len(new)
            start += own
    return PackedRows(input_ids=packed_ids.to(device), position_ids=positions.to(device),
                      attention_mask=tree_mask(segment).to(device), states=torch.cat(states).to(device),
                      targets=torch.cat(targets).to(device), pick=pick.to(device))


def tree_mask(segment: torch.Tensor) -> torch.Tensor:
    """[G, 1, L, L] bool from each packed position's segment [G, L] (0: the context, i + 1: the
    group's row i, -1: padding): a position sees the positions up to itself in the context and in
    its own segment; padding sees itself only (no empty softmax row)."""
    width = segment.shape[1]
    query, key = segment[:, :, None], segment[:, None, :]
    order = torch.arange(width)
    causal = order[None, :, None] >= order[None, None, :]
    sees = causal & (query >= 0) & ((key == 0) | (key == query))
    sees |= (query < 0) & torch.eye(width, dtype=torch.bool)[None]
    return sees[:, None]


def pair_cost_of(config: object) -> float:
    """`cost`'s price of one attended pair in tokens, from a transformers config: the attention's
    multiply-adds per pair (queries times keys and weights times values, every layer) over a token's
    through the layers' weights (attention projections and the MLP)."""
    hidden = config.hidden_size
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    mlp = getattr(config, "intermediate_size", None) or 4 * hidden
    per_token = hidden * head_dim * (2 * heads + 2 * kv_heads) + 3 * hidden * mlp
    return 2 * heads * head_dim / per_token


def supports(model: torch.nn.Module) -> bool:
    """Whether the model's attention takes the tree mask: PyTorch's SDPA, every layer full attention
    (a sliding window would be lost under a custom mask)."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "_attn_implementation", "sdpa") != "sdpa":
        return False
    layer_types = getattr(config, "layer_types", None) or []
    if any(kind != "full_attention" for kind in layer_types):
        return False
    return not (getattr(config, "use_sliding_window", False) and getattr(config, "sliding_window", None))
