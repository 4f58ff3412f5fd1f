"""Clip-Cov and KL-Cov (Cui et al. 2025, "The Entropy Mechanism of Reinforcement Learning for Reasoning
Language Models", arXiv:2505.22617): PPO variants that act on the tokens whose centred
advantage x log-probability covariance is largest, the ones that collapse entropy.

Per token, cov[t] = (A[t] - mean A) (log pi[t] - mean log pi), means over the masked tokens of the
batch given. Both return (loss [B, T], metrics) like `policy_losses`; neither applies the off-policy
correction (SkyRL 0.3.0 refuses the combination).

SkyRL computes these on the advantages already divided for the `loss_reduction`, so the covariance
bounds of clip-cov and the ranking of kl-cov under `sequence_mean` see the scaled values: pass what
the trainer passes to reproduce it (`skyrl_calls.py` does).
"""

from __future__ import annotations

import torch

from inflight.algorithms.masked import masked_mean

Metrics = dict[str, torch.Tensor]


def clip_cov_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    eps_clip_low: float = 0.2,
    eps_clip_high: float = 0.2,
    clip_ratio: float = 0.0002,
    clip_cov_lb: float = 1.0,
    clip_cov_ub: float = 5.0,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """Clip-Cov: l = max(-r A, -clip(r, 1 - eps_clip_low, 1 + eps_clip_high) A) * c, r = pi / pi_old
    (no clamp), where c = 0 (no gradient, no loss) for up to max(1, floor(clip_ratio * tokens)) tokens
    drawn at random (torch.randperm, `generator` or the default one, as SkyRL) among the masked tokens
    not already clipped by PPO whose cov lies in (clip_cov_lb, clip_cov_ub). `clip_ratio` metric: the
    masked fraction with c = 0."""
    ratio = torch.exp(log_probs - old_log_probs)
    pg1 = -advantages * ratio
    pg2 = -advantages * torch.clamp(ratio, 1 - eps_clip_low, 1 + eps_clip_high)
    live = loss_mask > 0
    with torch.no_grad():
        cov = (advantages - masked_mean(advantages, loss_mask)) * (
            log_probs.detach() - masked_mean(log_probs.detach(), loss_mask)
        )
        cov[~live | (pg2 > pg1)] = -torch.inf
        budget = max(int(clip_ratio * loss_mask.sum().item()), 1)
        candidates = torch.nonzero((cov < clip_cov_ub) & (cov > clip_cov_lb) & live)
        corr = torch.ones_like(advantages)
        if len(candidates) > 0:
            perm = torch.randperm(len(candidates), generator=generator)
            chosen = candidates[perm[: min(budget, len(candidates))]]
            corr[chosen[:, 0], chosen[:, 1]] = 0
    loss = torch.maximum(pg1, pg2) * corr
    return loss, {"clip_ratio": masked_mean((corr == 0).float(), loss_mask).detach()}


def kl_cov_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    kl_cov_frac: float = 0.2,
    ppo_kl_coef: float = 1.0,
) -> tuple[torch.Tensor, Metrics]:
    """KL-Cov: l = -r A (r = pi / pi_old, no clamp, no clip), plus ppo_kl_coef * |log pi - log pi_old| on
    the max(1, floor(kl_cov_frac * tokens)) masked tokens of largest cov (torch.topk, on CPU as SkyRL).
    `clip_ratio` is 0 (SkyRL reports none for this loss)."""
    log_ratio = log_probs - old_log_probs
    ratio = torch.exp(log_ratio)
    pg = -advantages * ratio
    pg_kl = pg + ppo_kl_coef * log_ratio.abs()
    live = loss_mask > 0
    selected = torch.zeros_like(live)
    with torch.no_grad():
        adv = advantages[live].reshape(-1).cpu()
        logp = log_probs.detach()[live].reshape(-1).cpu()
        if len(adv) > 0:
            cov = (adv - adv.mean()) * (logp - logp.mean())
            count = min(max(1, int(len(cov) * kl_cov_frac)), len(cov))
            top = torch.topk(cov, count, largest=True).indices
            live_positions = torch.nonzero(live.reshape(-1), as_tuple=True)[0]
            selected.view(-1)[live_positions[top.to(live_positions.device)]] = True
    return torch.where(selected, pg_kl, pg), {"clip_ratio": torch.tensor(0.0)}
