"""Token log-probabilities and pluggable losses `loss_fn(logprobs, batch) -> scalar`.

`logprobs[b, t]` is log p(input_ids[b, t] | input_ids[b, :t]) under the trained policy (position 0
is 0), so every loss reads the batch's tensors at the same positions.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from inflight.train.batch import TrainBatch

LossFn = Callable[[torch.Tensor, TrainBatch], torch.Tensor]


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """[B, T] log-probabilities of each token given its prefix, from [B, T, V] logits (float32,
    temperature-scaled like the engine's `logprobs`); position 0 is 0."""
    scaled = logits[:, :-1].float() / (temperature if temperature > 0 else 1.0)
    picked = torch.log_softmax(scaled, dim=-1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    return F.pad(picked, (1, 0))


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    mask = mask.to(values.dtype)
    return (values * mask).sum() / mask.sum().clamp_min(1.0)


def cross_entropy_loss(logprobs: torch.Tensor, batch: TrainBatch) -> torch.Tensor:
    """Token-mean negative log-likelihood of the masked tokens (supervised fine-tuning)."""
    return -masked_mean(logprobs, batch.loss_mask)


def policy_gradient_loss(eps_clip_low: float = 0.2, eps_clip_high: float = 0.2) -> LossFn:
    """PPO's clipped surrogate, token-mean over the mask. Without `old_logprobs` the ratio is 1 and
    the gradient is REINFORCE's: advantages times the gradient of the log-probabilities."""

    def loss(logprobs: torch.Tensor, batch: TrainBatch) -> torch.Tensor:
        if batch.advantages is None:
            raise ValueError("policy_gradient_loss needs batch.advantages")
        adv = batch.advantages
        adv = adv[:, None].expand_as(logprobs) if adv.dim() == 1 else adv
        old = batch.old_logprobs if batch.old_logprobs is not None else logprobs.detach()
        ratio = torch.exp(logprobs - old)
        clipped = ratio.clamp(1.0 - eps_clip_low, 1.0 + eps_clip_high)
        return masked_mean(-torch.minimum(ratio * adv, clipped * adv), batch.loss_mask)

    return loss
