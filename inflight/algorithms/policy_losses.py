"""Policy losses, per token: each returns (loss [B, T], metrics), the loss not yet masked or reduced.

`log_probs` are the policy's log-probabilities of the sampled tokens under training (with gradients),
`old_log_probs` the same policy's before this batch's updates (one forward without gradients),
`rollout_logprobs` the inference engine's when it sampled. r = pi / pi_old = exp(log_probs - old),
its log clamped to +-20 where noted (`masked.safe_exp`). Metrics are detached 0-d tensors (call
`float()` when logging); `clip_ratio` is a masked token fraction.

SkyRL 0.3.0 reduces every one of these as sum(loss * loss_mask) after the off-policy correction, with
advantages already divided for the `loss_reduction` (`reductions.scale_advantages`): `skyrl_calls.py`
does exactly that under SkyRL's names. The clip-cov and KL-cov losses are in `cov_losses.py`.
"""

from __future__ import annotations

import torch

from inflight.algorithms.masked import masked_mean, safe_exp

Metrics = dict[str, torch.Tensor]
DPPO_TYPES = ("binary_tv", "binary_kl")


def _clip_ppo(
    ratio: torch.Tensor, advantages: torch.Tensor, loss_mask: torch.Tensor, low: float, high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    surr1 = ratio * advantages
    surr2 = ratio.clamp(1 - low, 1 + high) * advantages
    clip_ratio = masked_mean((-surr2 > -surr1).float(), loss_mask).detach()
    return -torch.min(surr1, surr2), clip_ratio


def ppo_clip_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    eps_clip_low: float = 0.2,
    eps_clip_high: float = 0.2,
    clip_ratio_c: float | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """PPO-clip (Schulman et al. 2017, arXiv:1707.06347; `regular`), asymmetric bounds (DAPO):

        l = -min(r A, clip(r, 1 - eps_clip_low, 1 + eps_clip_high) A)

    With `clip_ratio_c` (`dual_clip`, Ye et al. 2019, arXiv:1912.09729; SkyRL default 3.0), tokens with
    A < 0 take min(l, -c A), bounding the loss of a very large ratio. `clip_ratio` counts tokens where the
    clipped surrogate is the smaller (before dual clipping)."""
    if clip_ratio_c is not None and clip_ratio_c <= 1.0:
        raise ValueError(f"trainer.algorithm.clip_ratio_c must be > 1 for dual-clip PPO, got {clip_ratio_c}")
    ratio = safe_exp(log_probs - old_log_probs)
    loss, clip_ratio = _clip_ppo(ratio, advantages, loss_mask, eps_clip_low, eps_clip_high)
    if clip_ratio_c is not None:
        loss = torch.where(advantages < 0, torch.min(-advantages * clip_ratio_c, loss), loss)
    return loss, {"clip_ratio": clip_ratio}


def gspo_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    eps_clip_low: float = 0.2,
    eps_clip_high: float = 0.2,
) -> tuple[torch.Tensor, Metrics]:
    """GSPO-token (Zheng et al. 2025, arXiv:2507.18071, eq. 14-15): PPO-clip on the sequence ratio

        s_i = exp(masked mean over t of (log_probs - old)),  s_i,t = sg[s_i] * pi / sg[pi]

    (value s_i, gradient of log pi at each token), its log clamped above at 10. The paper (and SkyRL's
    warning) pairs it with `loss_reduction=sequence_mean`."""
    log_seq = masked_mean(log_probs - old_log_probs, loss_mask, dim=-1).unsqueeze(-1)
    log_ratio = torch.clamp(log_probs - log_probs.detach() + log_seq.detach(), max=10)
    loss, clip_ratio = _clip_ppo(torch.exp(log_ratio), advantages, loss_mask, eps_clip_low, eps_clip_high)
    return loss, {"clip_ratio": clip_ratio}


def sapo_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
) -> tuple[torch.Tensor, Metrics]:
    """SAPO (Soft Adaptive Policy Optimization, arXiv:2511.20347): a soft gate in place of the clip,

        l = -f(r, tau) A,  f(r, tau) = sigmoid(tau (r - 1)) * 4 / tau,  tau = tau_pos if A > 0 else tau_neg

    (r's log clamped to +-20). The paper uses `loss_reduction=sequence_mean`. `clip_ratio` is 0."""
    tau_p = torch.as_tensor(tau_pos, dtype=advantages.dtype, device=advantages.device)
    tau_n = torch.as_tensor(tau_neg, dtype=advantages.dtype, device=advantages.device)
    ratio = torch.exp(torch.clamp(log_probs - old_log_probs, min=-20.0, max=20.0))
    taus = torch.where(advantages > 0, tau_p, tau_n)
    gates = torch.sigmoid(taus * (ratio - 1.0)) * (4.0 / taus)
    return -gates * advantages, {"clip_ratio": torch.tensor(0.0)}


def cispo_loss(
    log_probs: torch.Tensor,
    behavior_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    eps_clip_low: float = 0.0,
    eps_clip_high: float = 5.0,
) -> tuple[torch.Tensor, Metrics]:
    """CISPO (MiniMax-M1, arXiv:2506.13585): clip the importance weight, not the update,

        l = -sg[clip(r, 1 - eps_clip_low, 1 + eps_clip_high)] A log pi

    r = pi / pi_behavior: the old policy (`cispo_anchor=old`) or the rollout's (`rollout`). Every token
    keeps a gradient. Defaults are SkyRL 0.3.0's (low 0.0, high 5.0: r in [1, 6]; SkyRL later moved to
    1.0 and 4.0, r in [0, 5]). Metrics: `clip_ratio` (tokens outside the bounds) and SkyRL's
    `cispo/ratio_mean`, `cispo/ratio_clamped_mean` (masked means), `cispo/ratio_max`, `cispo/ratio_min`
    (over masked tokens; over all tokens when none is masked)."""
    ratio = safe_exp(log_probs - behavior_log_probs)
    low, high = 1 - eps_clip_low, 1 + eps_clip_high
    clamped = torch.clamp(ratio, low, high)
    loss = -advantages * clamped.detach() * log_probs
    live = loss_mask.bool()
    active = ratio[live] if live.any() else ratio
    return loss, {
        "clip_ratio": masked_mean(((ratio < low) | (ratio > high)).float(), loss_mask).detach(),
        "cispo/ratio_mean": masked_mean(ratio, loss_mask).detach(),
        "cispo/ratio_clamped_mean": masked_mean(clamped, loss_mask).detach(),
        "cispo/ratio_max": active.max().detach(),
        "cispo/ratio_min": active.min().detach(),
    }


def rollout_is_loss(
    log_probs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    eps_clip_low: float = 0.2,
    eps_clip_high: float = 0.2,
) -> tuple[torch.Tensor, Metrics]:
    """Rollout-IS (GLM-5 report, arXiv:2602.15763 sec. 4.1.2; IcePop-style): with r = pi / pi_rollout,

        l = -sg[r * 1{1 - eps_clip_low < r < 1 + eps_clip_high}] A log pi

    tokens outside the open interval get no gradient. Needs no old log-probs (the trainer may skip that
    forward). `clip_ratio` counts tokens outside the interval."""
    ratio = safe_exp(log_probs - rollout_logprobs)
    inside = (ratio > 1 - eps_clip_low) & (ratio < 1 + eps_clip_high)
    weight = torch.where(inside, ratio, torch.zeros_like(ratio))
    loss = -(weight.detach() * advantages * log_probs)
    return loss, {"clip_ratio": masked_mean((~inside).float(), loss_mask).detach()}


def dppo_loss(
    log_probs: torch.Tensor,
    behavior_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    dppo_type: str = "binary_tv",
    delta_low: float = 0.2,
    delta_high: float = 0.2,
) -> tuple[torch.Tensor, Metrics]:
    """DPPO (arXiv:2602.04879): a divergence trust region in place of ratio clipping,

        l = -r A M,  r = pi / mu (log clamped +-20),  M in {0, 1} (no gradient)

    mu is the rollout policy when its log-probs exist, else the old policy (SkyRL's choice). With
    p = pi(token), q = mu(token): `binary_tv` drops tokens with A > 0 and p - q > delta_high or A < 0 and
    q - p > delta_low (eq. 13); `binary_kl` drops A > 0, p > q or A < 0, p < q when the Bernoulli KL
    q log(q/p) + (1-q) log((1-q+1e-8)/(1-p+1e-8)) exceeds delta_high (resp. delta_low) (eq. 14).
    `clip_ratio` counts dropped tokens."""
    if dppo_type not in DPPO_TYPES:
        raise ValueError(
            f"trainer.algorithm.dppo.dppo_type={dppo_type!r}: use one of {', '.join(DPPO_TYPES)}"
        )
    ratio = safe_exp(log_probs - behavior_log_probs)
    with torch.no_grad():
        p, q = torch.exp(log_probs), torch.exp(behavior_log_probs)
        diff = p - q
        mask = torch.ones_like(advantages)
        if dppo_type == "binary_tv":
            mask[(advantages > 0) & (diff > delta_high)] = 0.0
            mask[(advantages < 0) & (-diff > delta_low)] = 0.0
        else:
            eps = 1e-8
            bkl = q * (behavior_log_probs - log_probs) + (1 - q) * torch.log((1 - q + eps) / (1 - p + eps))
            mask[(advantages > 0) & (diff > 0) & (bkl > delta_high)] = 0.0
            mask[(advantages < 0) & (diff < 0) & (bkl > delta_low)] = 0.0
    loss = -(ratio * advantages * mask)
    return loss, {"clip_ratio": masked_mean((mask == 0).float(), loss_mask).detach()}


def importance_sampling_loss(
    log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor, loss_mask: torch.Tensor
) -> tuple[torch.Tensor, Metrics]:
    """Importance-weighted policy gradient (Tinker's `importance_sampling`): l = -exp(log pi - log q) A,
    q the sampling policy (`old_log_probs`), no clamp. Metric `importance_ratio`: the masked mean ratio
    (NaN when nothing is masked in, as in SkyRL)."""
    ratio = torch.exp(log_probs - old_log_probs)
    mean_ratio = (ratio * loss_mask).sum() / loss_mask.sum()
    return -(ratio * advantages), {"importance_ratio": mean_ratio.detach()}


def cross_entropy_loss(log_probs: torch.Tensor, loss_mask: torch.Tensor) -> tuple[torch.Tensor, Metrics]:
    """Supervised negative log-likelihood (Tinker's `cross_entropy`): l = -log pi. It reads no advantage,
    so SkyRL's reduction is the plain sum over masked tokens. `clip_ratio` is 0."""
    return -log_probs, {"clip_ratio": torch.tensor(0.0)}
