"""Loss reductions (`trainer.algorithm.loss_reduction`), SkyRL 0.3.0 style: by scaling the advantages.

SkyRL divides each mini-batch's advantages so that the policy loss *summed* over its masked tokens
(`masked.reduce_loss`, what every policy loss returns) is the wanted mean. For a mini-batch of B rows,
M[i, t] the loss mask, the advantage of token (i, t) is divided by:

- `token_mean`: sum M over the mini-batch (>= 1): the mean over all its tokens (DAPO).
- `token_mean_legacy`: for each micro-batch of `micro_batch_size` rows, its own sum M (>= 1), times the
  number of micro-batches: the mean of per-micro-batch token means (SkyRL's old `token_mean`).
- `sequence_mean`: B * sum_t M[i, t] (>= 1): each row's token mean, averaged over rows.
- `seq_mean_token_sum_norm`: B * max_seq_len: each row's token sum over a constant length, averaged
  (Dr. GRPO, arXiv:2503.20783). `max_seq_len` is `trainer.algorithm.max_seq_len`, not the batch's
  longest response; SkyRL refuses to start when it is None (so do we: ValueError).
- `prompt_mean`: P * (sum of M over the rows of the row's prompt) (>= 1), P the prompts in the
  mini-batch: the token mean within each prompt, averaged over prompts. Rows outside every prompt
  slice get advantage 0.

All-masked rows contribute nothing (their tokens are masked); an all-masked mini-batch divides by 1.
The division happens once per mini-batch before the update epochs, on the whole mini-batch before it is
cut into micro-batches and data-parallel shards; the worker multiplies each micro-batch's summed loss
by the data-parallel size so the gradient all-reduce (a mean) restores the sum.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

LOSS_REDUCTIONS = (
    "token_mean",
    "token_mean_legacy",
    "sequence_mean",
    "seq_mean_token_sum_norm",
    "prompt_mean",
)


def scale_advantages(
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    loss_reduction: str,
    *,
    micro_batch_size: int | None = None,
    max_seq_len: int | None = None,
    prompt_boundaries: Sequence[tuple[int, int]] | None = None,
) -> torch.Tensor:
    """One mini-batch's advantages [B, T] divided for `loss_reduction` (module docstring); SkyRL's
    `apply_loss_reduction_to_advantages_minibatch`.

    `micro_batch_size` (`trainer.micro_train_batch_size_per_gpu`) is read by `token_mean_legacy` only,
    `max_seq_len` by `seq_mean_token_sum_norm` only, `prompt_boundaries` (mini-batch-relative
    (start, end) row slices, `groups.prompt_boundaries`) by `prompt_mean` only."""
    batch = advantages.shape[0]
    if loss_reduction == "token_mean":
        return advantages / loss_mask.sum().clamp(min=1)
    if loss_reduction == "token_mean_legacy":
        return _token_mean_legacy(advantages, loss_mask, micro_batch_size)
    if loss_reduction == "sequence_mean":
        return advantages / (batch * loss_mask.sum(dim=-1, keepdim=True).clamp(min=1))
    if loss_reduction == "seq_mean_token_sum_norm":
        if max_seq_len is None or max_seq_len <= 0:
            raise ValueError(
                f"loss_reduction=seq_mean_token_sum_norm divides by trainer.algorithm.max_seq_len, which is "
                f"{max_seq_len}: set it to the sequence-length budget (often the model's context length)"
            )
        return advantages / (batch * max_seq_len)
    if loss_reduction == "prompt_mean":
        if prompt_boundaries is None:
            raise ValueError("loss_reduction=prompt_mean needs the prompt boundaries of the mini-batch")
        out = torch.zeros_like(advantages)
        for start, end in prompt_boundaries:
            tokens = loss_mask[start:end].sum().clamp(min=1)
            out[start:end] = advantages[start:end] / (len(prompt_boundaries) * tokens)
        return out
    raise ValueError(
        f"trainer.algorithm.loss_reduction={loss_reduction!r}: use one of {', '.join(LOSS_REDUCTIONS)}"
    )


def _token_mean_legacy(
    advantages: torch.Tensor, loss_mask: torch.Tensor, micro_batch_size: int | None
) -> torch.Tensor:
    batch = advantages.shape[0]
    if micro_batch_size is None or micro_batch_size <= 0 or batch % micro_batch_size:
        # SkyRL would give the rows past the last whole micro-batch advantage 0 without a word.
        raise ValueError(
            f"loss_reduction=token_mean_legacy needs mini-batches of whole micro-batches: {batch} rows "
            f"and micro_batch_size={micro_batch_size} (trainer.micro_train_batch_size_per_gpu)"
        )
    count = batch // micro_batch_size
    out = torch.zeros_like(advantages)
    for start in range(0, batch, micro_batch_size):
        end = start + micro_batch_size
        part = advantages[start:end] / loss_mask[start:end].sum().clamp(min=1)
        out[start:end] = part / count
    return out


def scale_minibatch_advantages(
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    loss_reduction: str,
    mini_batch_boundaries: Sequence[tuple[int, int]],
    *,
    micro_batch_size: int | None = None,
    max_seq_len: int | None = None,
    prompt_boundaries: Sequence[tuple[int, int]] | None = None,
) -> torch.Tensor:
    """`scale_advantages` on each (start, end) mini-batch of a training batch (SkyRL's trainer
    `_normalize_advantages`, step 2). `prompt_boundaries` are batch-level; each mini-batch gets the
    prompts that start inside it, made relative to it. Rows outside every mini-batch get 0."""
    out = torch.zeros_like(advantages)
    for start, end in mini_batch_boundaries:
        local = None
        if prompt_boundaries is not None:
            local = [(p - start, q - start) for p, q in prompt_boundaries if start <= p < end]
        out[start:end] = scale_advantages(
            advantages[start:end],
            loss_mask[start:end],
            loss_reduction,
            micro_batch_size=micro_batch_size,
            max_seq_len=max_seq_len,
            prompt_boundaries=local,
        )
    return out
