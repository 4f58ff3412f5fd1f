"""Token entropy of the policy and SkyRL's entropy bonus.

H[t] = -sum_v p_v log p_v over the vocabulary, from logits already divided by the sampling
temperature (SkyRL scales the logits by `trainer.algorithm.temperature` before log-probs and entropy).

The SkyRL 0.3.0 worker always measures `policy_entropy = masked_mean(H, loss_mask)` over a micro-batch
(a token mean); with `use_entropy_loss` it subtracts `entropy_loss_coef` times that mean, weighted by the
micro-batch's share of rows, from the loss (`entropy_loss_term`; gradients flow through H only then).
"""

from __future__ import annotations

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
