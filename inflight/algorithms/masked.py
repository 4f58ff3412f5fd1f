"""Masked reductions and the clamped exponential every estimator and loss here is built on.

Masks are float (or int/bool) tensors of the values' shape, 1 where a position counts. These follow
SkyRL 0.3.0's `torch_utils.masked_mean`, `safe_exp_delta` and `ppo_utils.masked_var / masked_whiten`
operation for operation, so results agree with SkyRL's to the last bit on the same device.
"""

from __future__ import annotations

import torch


def masked_mean(values: torch.Tensor, mask: torch.Tensor | None, dim: int | None = None) -> torch.Tensor:
    """sum(values * mask) / max(sum(mask), 1), over `dim` (all elements when None).

    The clamp makes an all-masked row (or batch) average to 0 instead of NaN. `mask=None` is the plain
    mean (SkyRL's convention)."""
    if mask is None:
        return values.mean() if dim is None else values.mean(dim=dim)
    if dim is None:
        return (values * mask).sum() / mask.sum().clamp(min=1.0)
    return (values * mask).sum(dim=dim) / mask.sum(dim=dim).clamp(min=1.0)


def masked_var(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Unbiased masked variance: masked_mean((v - masked_mean(v))^2) * n / (n - 1), n = sum(mask).

    Raises ValueError when fewer than two positions are unmasked (the Bessel factor is undefined);
    SkyRL raises there too."""
    mean = masked_mean(values, mask)
    variance = masked_mean((values - mean) ** 2, mask)
    count = mask.sum()
    if count == 0 or count == 1:
        raise ValueError(
            f"a masked variance needs at least 2 unmasked positions, the mask has {int(count.item())}: "
            "whitening (reinforce++, gae) cannot run on this batch; give it more response tokens "
            "(a larger mini-batch) or use an outcome estimator (grpo, rloo)"
        )
    return variance * (count / (count - 1))


def masked_whiten(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(values - masked_mean) / sqrt(masked_var + 1e-8) at every position (masked ones included)."""
    mean, var = masked_mean(values, mask), masked_var(values, mask)
    return (values - mean) * torch.rsqrt(var + 1e-8)


def safe_exp(delta: torch.Tensor, clip: float = 20.0) -> torch.Tensor:
    """exp(clamp(delta, -clip, clip)) computed in float32, returned in `delta`'s dtype (SkyRL's
    `safe_exp_delta`): a log-ratio of +-20 is already a ratio of 5e8, and the clamp keeps exp finite."""
    return torch.clamp(delta.to(torch.float32), -clip, clip).exp().to(delta.dtype)


def reduce_loss(loss: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """sum(loss * loss_mask): SkyRL 0.3.0's `reduce_loss`. The mean a `loss_reduction` asks for is made
    beforehand by scaling the advantages (`reductions.scale_advantages`), so a sum here is that mean."""
    return (loss * loss_mask).sum()
