"""Token entropy of the policy and SkyRL's entropy bonus.

H[t] = -sum_v p_v log p_v over the vocabulary, from logits already divided by the sampling
temperature (SkyRL scales the logits by `trainer.algorithm.temperature` before log-probs and entropy).

The SkyRL 0.3.0 worker takes the entropy of each micro-batch (`micro_train_batch_size_per_gpu`
consecutive rows of a mini-batch) as a token mean, masked_mean(H, loss_mask) (`entropy_loss_term`);
with `use_entropy_loss` it subtracts `entropy_loss_coef` times that mean, weighted by the micro-batch's
share of the mini-batch's rows, from the loss (gradients flow through H only then), and it logs
`policy_entropy` as the mean over the micro-batches of those means. At its default micro-batch of one
row, that is the mean of per-row token means, not a token mean over the mini-batch.
`entropy_token_weights` gives each row's tokens the weight that reproduces it whatever micro-batches
a step actually runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext

import torch
import torch.nn.functional as F

from inflight.algorithms.masked import masked_mean


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """H over the last dim: -(softmax * log_softmax).sum(-1); [..., V] -> [...]."""
    log_p = F.log_softmax(logits, dim=-1)
    return -(log_p.exp() * log_p).sum(-1)


def chunked_entropy_from_logits(
    logits: torch.Tensor,
    chunk_size: int = 1024,
    attention_mask: torch.Tensor | None = None,
    requires_grad: bool = False,
) -> torch.Tensor:
    """`entropy_from_logits` of [B, S, V] logits, S cut into chunks of `chunk_size` positions so only
    one chunk's log-softmax [B, chunk, V] exists at a time (SkyRL's `chunked_entropy_from_logits`).

    Positions where `attention_mask` ([B, S]) is 0 get 0. Without `requires_grad` it runs under no_grad."""
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be a positive number of positions, got {chunk_size}")
    if logits.dim() != 3:
        raise ValueError(f"logits must be [B, S, V], got {tuple(logits.shape)}")
    if attention_mask is not None and attention_mask.shape != logits.shape[:2]:
        raise ValueError(
            f"attention_mask {tuple(attention_mask.shape)} must be [B, S] = {tuple(logits.shape[:2])}"
        )
    with nullcontext() if requires_grad else torch.no_grad():
        out = torch.zeros(logits.shape[:2], dtype=logits.dtype, device=logits.device)
        for start in range(0, logits.shape[1], chunk_size):
            end = min(start + chunk_size, logits.shape[1])
            chunk = entropy_from_logits(logits[:, start:end])
            if attention_mask is not None:
                chunk = chunk * attention_mask[:, start:end]
            out[:, start:end] = chunk
    return out


def entropy_loss_term(
    entropy: torch.Tensor, loss_mask: torch.Tensor, entropy_loss_coef: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(entropy_loss_coef * masked_mean(H, loss_mask), masked_mean(H, loss_mask)): the term SkyRL
    subtracts from a micro-batch's loss under `use_entropy_loss`, and the `policy_entropy` metric."""
    mean = masked_mean(entropy, loss_mask)
    return mean * entropy_loss_coef, mean


def entropy_token_weights(
    loss_mask: torch.Tensor, mini_batches: Sequence[tuple[int, int]], micro_batch_size: int
) -> torch.Tensor:
    """[B] the weight of each row's masked tokens in SkyRL's entropy of its mini-batch, so that
    sum(H * loss_mask * weights[:, None]) over a mini-batch's rows is SkyRL's entropy term and logged
    `policy_entropy` (module docstring) however its rows are cut.

    Each (start, end) mini-batch is cut into micro-batches of `micro_batch_size` consecutive rows (the
    last may be shorter; SkyRL refuses that); a row of micro-batch m weighs (rows of m / rows of the
    mini-batch) / max(masked tokens of m, 1). Rows without tokens still count as rows (SkyRL keeps
    zero-variance-filtered rows in its micro-batches); rows outside every mini-batch weigh 0."""
    if micro_batch_size <= 0:
        raise ValueError(f"micro_batch_size must be a positive number of rows, got {micro_batch_size}")
    tokens = loss_mask.sum(dim=-1).to(torch.float64)
    weights = torch.zeros(loss_mask.shape[0], dtype=torch.float64)
    for start, end in mini_batches:
        for at in range(start, end, micro_batch_size):
            stop = min(at + micro_batch_size, end)
            weights[at:stop] = (stop - at) / (end - start) / tokens[at:stop].sum().clamp(min=1.0)
    return weights.to(loss_mask.dtype if loss_mask.is_floating_point() else torch.float32)
