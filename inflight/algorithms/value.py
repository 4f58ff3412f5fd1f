"""The critic's loss (SkyRL 0.3.0's `ppo_critic_loss`), for `advantage_estimator=gae` runs."""

from __future__ import annotations

import torch

from inflight.algorithms.masked import masked_mean


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    loss_mask: torch.Tensor | None,
    value_clip: float | None = 0.2,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Clipped value loss (PPO, Schulman et al. 2017; `trainer.algorithm.value_clip`, SkyRL default 0.2):

        V_clip = V_old + clamp(V - V_old, -value_clip, value_clip)
        l[t]   = max((V_clip - R)^2, (V - R)^2)             ((V - R)^2 when value_clip is None)
        loss   = 0.5 * mean over rows of the row's masked token mean of l

    `old_values` are the critic's values when the batch was made (the ones GAE used), `returns` GAE's
    returns. Returns (loss, clipfrac): the masked fraction of tokens where the clipped term is the larger
    (None without clipping). The reduction is always this per-row mean, whatever `loss_reduction` says."""
    if value_clip is not None:
        clipped = old_values + (values - old_values).clamp(-value_clip, value_clip)
        surr_clipped = (clipped - returns) ** 2
        surr = (values - returns) ** 2
        loss = torch.max(surr_clipped, surr)
        clipfrac = masked_mean((surr_clipped > surr).float(), loss_mask).mean().detach()
    else:
        clipfrac = None
        loss = (values - returns) ** 2
    return 0.5 * masked_mean(loss, loss_mask, dim=-1).mean(), clipfrac
