"""Off-policy correction between the rollout policy and the trainer's (SkyRL 0.3.0's
`off_policy_correction_utils`, `trainer.algorithm.off_policy_correction.*`).

With rho[t] = pi_old[t] / pi_rollout[t] = exp(old_log_probs - rollout_logprobs) (log-ratio clamped to
+-20), applied inside every policy loss except clip_cov, kl_cov, cross_entropy, importance_sampling:

1. outlier masks (`outlier_token_is_threshold_low/high`, either or both): a row with any masked token
   whose rho is below low or above high is dropped whole (its loss mask becomes 0);
2. token mask (`token_mask_is_threshold_low` and `_high`, both): tokens with rho outside [low, high]
   are dropped;
3. TIS (`tis_ratio_type`): each token's loss is multiplied by min(rho[t], token_tis_ratio_clip_high)
   (`token`), or each row's by min(prod_t rho[t], sequence_tis_ratio_clip_high) (`sequence`, product
   over the mask left by 1-2, log-sum clamped to +-20); no gradient flows through the weight;
4. sequence mask (`sequence_mask_metric`): rows whose geometric mean of rho (`geometric`, outside
   [geo_mask_low, geo_mask_high]) or product of rho (`product`, outside [product_mask_low,
   product_mask_high]) is out of bounds are dropped.

References: Yao et al., "Your efficient RL framework secretly brings you off-policy RL training"
(https://fengyao.notion.site/off-policy-rl); verl's rollout-correction notes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from inflight.algorithms.masked import masked_mean, safe_exp

TIS_RATIO_TYPES = ("token", "sequence")
SEQUENCE_MASK_METRICS = ("geometric", "product")
_FIELDS = (
    "tis_ratio_type",
    "token_tis_ratio_clip_high",
    "sequence_tis_ratio_clip_high",
    "sequence_mask_metric",
    "geo_mask_high",
    "geo_mask_low",
    "product_mask_high",
    "product_mask_low",
    "outlier_token_is_threshold_low",
    "outlier_token_is_threshold_high",
    "token_mask_is_threshold_low",
    "token_mask_is_threshold_high",
)


@dataclass(frozen=True)
class OffPolicyCorrection:
    """`trainer.algorithm.off_policy_correction` (SkyRL's names and defaults; all off by default)."""

    tis_ratio_type: str | None = None
    token_tis_ratio_clip_high: float = 2.0
    sequence_tis_ratio_clip_high: float = 5.0
    sequence_mask_metric: str | None = None
    geo_mask_high: float = 1.01
    geo_mask_low: float = 0.99
    product_mask_high: float = 2.0
    product_mask_low: float = 0.5
    outlier_token_is_threshold_low: float | None = None
    outlier_token_is_threshold_high: float | None = None
    token_mask_is_threshold_low: float | None = None
    token_mask_is_threshold_high: float | None = None

    def __post_init__(self) -> None:
        key = "trainer.algorithm.off_policy_correction"
        if self.tis_ratio_type not in (None, *TIS_RATIO_TYPES):
            raise ValueError(f"{key}.tis_ratio_type={self.tis_ratio_type!r}: use null, 'token' or 'sequence'")
        if self.sequence_mask_metric not in (None, *SEQUENCE_MASK_METRICS):
            raise ValueError(
                f"{key}.sequence_mask_metric={self.sequence_mask_metric!r}: "
                "use null, 'geometric' or 'product'"
            )
        if (self.token_mask_is_threshold_low is None) != (self.token_mask_is_threshold_high is None):
            # SkyRL silently ignores a one-sided token mask; refusing it is the honest answer.
            raise ValueError(
                f"{key}.token_mask_is_threshold_low and _high work together: set both (or neither), got "
                f"low={self.token_mask_is_threshold_low}, high={self.token_mask_is_threshold_high}"
            )

    @classmethod
    def from_config(cls, config: Any) -> OffPolicyCorrection:
        """From any object with these attributes (SkyRL's OffPolicyCorrectionConfig, ours, a namespace)."""
        if isinstance(config, OffPolicyCorrection):
            return config
        return cls(**{name: getattr(config, name) for name in _FIELDS if hasattr(config, name)})

    @property
    def outlier_mask(self) -> bool:
        """Whether step 1 runs (either outlier threshold set)."""
        return (
            self.outlier_token_is_threshold_low is not None
            or self.outlier_token_is_threshold_high is not None
        )

    @property
    def token_mask(self) -> bool:
        """Whether step 2 runs (both token-mask thresholds set)."""
        return self.token_mask_is_threshold_low is not None

    @property
    def enabled(self) -> bool:
        """Whether any correction applies (SkyRL's `off_policy_correction_enabled`)."""
        return (
            self.tis_ratio_type is not None
            or self.sequence_mask_metric is not None
            or self.outlier_mask
            or self.token_mask
        )


Metrics = dict[str, torch.Tensor]


def _ratio(old_log_probs: torch.Tensor, rollout_logprobs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    log_ratio = old_log_probs - rollout_logprobs
    return log_ratio, safe_exp(log_ratio)


def tis_ratio(
    old_log_probs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    loss_mask: torch.Tensor,
    cfg: OffPolicyCorrection,
) -> tuple[torch.Tensor, Metrics]:
    """Truncated importance weight (step 3): [B, T] for `token`, [B, 1] for `sequence`, detached.

    Metrics: `tis_token_clip_high_ratio` (fraction of masked tokens capped) or `tis_seq_clip_high_ratio`
    (fraction of all rows capped)."""
    log_ratio, ratio = _ratio(old_log_probs, rollout_logprobs)
    if cfg.tis_ratio_type == "token":
        cap = cfg.token_tis_ratio_clip_high
        capped = (ratio > cap) & (loss_mask > 0)
        frac = capped.sum() / (loss_mask > 0).sum().clamp(min=1)
        return torch.clamp(ratio, max=cap).detach(), {"tis_token_clip_high_ratio": frac.detach()}
    if cfg.tis_ratio_type == "sequence":
        seq_ratio = safe_exp((log_ratio * loss_mask).sum(dim=-1, keepdim=True))
        cap = cfg.sequence_tis_ratio_clip_high
        frac = (seq_ratio > cap).sum() / seq_ratio.shape[0]
        return torch.clamp(seq_ratio, max=cap).detach(), {"tis_seq_clip_high_ratio": frac.detach()}
    raise ValueError(f"tis_ratio needs tis_ratio_type 'token' or 'sequence', got {cfg.tis_ratio_type!r}")


def outlier_token_mask(
    old_log_probs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    loss_mask: torch.Tensor,
    cfg: OffPolicyCorrection,
) -> tuple[torch.Tensor, Metrics]:
    """Step 1: [B, 1] float, 0 for rows with a masked token's rho outside the outlier thresholds.

    Metrics: `outlier_seq_masked_ratio`, `outlier_seq_over_high_ratio`, `outlier_seq_under_low_ratio`
    (fractions of all rows)."""
    _, ratio = _ratio(old_log_probs, rollout_logprobs)
    live = loss_mask > 0
    none = torch.zeros_like(loss_mask, dtype=torch.bool)
    high, low = cfg.outlier_token_is_threshold_high, cfg.outlier_token_is_threshold_low
    over = (ratio > high) & live if high is not None else none
    under = (ratio < low) & live if low is not None else none
    row_ok = ((~over & ~under) | (loss_mask == 0)).all(dim=-1, keepdim=True)
    rows = float(row_ok.shape[0])
    metrics = {
        "outlier_seq_masked_ratio": ((~row_ok.squeeze(-1)).sum() / rows).detach(),
        "outlier_seq_over_high_ratio": (over.any(dim=-1).sum() / rows).detach(),
        "outlier_seq_under_low_ratio": (under.any(dim=-1).sum() / rows).detach(),
    }
    return row_ok.float(), metrics


def token_is_mask(
    old_log_probs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    loss_mask: torch.Tensor,
    cfg: OffPolicyCorrection,
) -> tuple[torch.Tensor, Metrics]:
    """Step 2: [B, T] float, 0 for masked tokens with rho outside [low, high] (bounds kept).

    Metric: `token_mask_ratio`, the fraction of masked tokens dropped."""
    _, ratio = _ratio(old_log_probs, rollout_logprobs)
    inside = (ratio >= cfg.token_mask_is_threshold_low) & (ratio <= cfg.token_mask_is_threshold_high)
    live = loss_mask > 0
    frac = (~inside & live).sum() / live.sum().clamp(min=1)
    return (inside | (loss_mask == 0)).float(), {"token_mask_ratio": frac.detach()}


def sequence_mask(
    old_log_probs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    loss_mask: torch.Tensor,
    cfg: OffPolicyCorrection,
) -> tuple[torch.Tensor, Metrics]:
    """Step 4: [B, 1] float, 0 for rows whose geometric mean (or product) of rho is out of bounds.

    Metrics: `{geo,product}_sequence_mask_{masked,over_high,under_low}_ratio` (fractions of all rows)."""
    log_ratio = old_log_probs - rollout_logprobs
    log_sum = (log_ratio * loss_mask).sum(dim=-1, keepdim=True)
    if cfg.sequence_mask_metric == "geometric":
        stat = safe_exp(log_sum / loss_mask.sum(dim=-1, keepdim=True).clamp(min=1.0))
        low, high, prefix = cfg.geo_mask_low, cfg.geo_mask_high, "geo"
    elif cfg.sequence_mask_metric == "product":
        stat = safe_exp(log_sum)
        low, high, prefix = cfg.product_mask_low, cfg.product_mask_high, "product"
    else:
        raise ValueError(f"sequence_mask needs 'geometric' or 'product', got {cfg.sequence_mask_metric!r}")
    over, under = stat > high, stat < low
    keep = ~over & ~under
    rows = float(stat.shape[0])
    metrics = {
        f"{prefix}_sequence_mask_masked_ratio": ((~keep).sum() / rows).detach(),
        f"{prefix}_sequence_mask_over_high_ratio": (over.sum() / rows).detach(),
        f"{prefix}_sequence_mask_under_low_ratio": (under.sum() / rows).detach(),
    }
    return keep.float(), metrics


def off_policy_correction(
    old_log_probs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    loss_mask: torch.Tensor,
    cfg: OffPolicyCorrection,
) -> tuple[torch.Tensor | None, Metrics, torch.Tensor]:
    """Steps 1-4 in SkyRL's order: (TIS weight or None, metrics, the new loss mask), SkyRL's tuple order.

    Also reports rho over the masked tokens as SkyRL does: `is_ratio_mean` (masked mean) and
    `is_ratio_std/max/min` of rho * mask over all B*T positions (masked ones count as 0)."""
    if not cfg.enabled:
        return None, {}, loss_mask
    _, ratio = _ratio(old_log_probs, rollout_logprobs)
    weighted = ratio * loss_mask
    metrics: Metrics = {
        "is_ratio_mean": masked_mean(ratio, loss_mask).detach(),
        "is_ratio_std": weighted.std().detach(),
        "is_ratio_max": weighted.max().detach(),
        "is_ratio_min": weighted.min().detach(),
    }
    if cfg.outlier_mask:
        mask, step = outlier_token_mask(old_log_probs, rollout_logprobs, loss_mask, cfg)
        loss_mask = loss_mask * mask
        metrics.update(step)
    if cfg.token_mask:
        mask, step = token_is_mask(old_log_probs, rollout_logprobs, loss_mask, cfg)
        loss_mask = loss_mask * mask
        metrics.update(step)
    weight = None
    if cfg.tis_ratio_type is not None:
        weight, step = tis_ratio(old_log_probs, rollout_logprobs, loss_mask, cfg)
        metrics.update(step)
    if cfg.sequence_mask_metric is not None:
        mask, step = sequence_mask(old_log_probs, rollout_logprobs, loss_mask, cfg)
        loss_mask = loss_mask * mask
        metrics.update(step)
    return weight, metrics, loss_mask


def apply_off_policy_correction(
    loss: torch.Tensor,
    old_log_probs: torch.Tensor,
    rollout_logprobs: torch.Tensor | None,
    loss_mask: torch.Tensor,
    cfg: OffPolicyCorrection,
) -> tuple[torch.Tensor, torch.Tensor, Metrics]:
    """(loss * TIS weight, corrected mask, metrics); unchanged when `rollout_logprobs` is None (SkyRL
    then skips the correction silently: the trainer should refuse an enabled correction without them)."""
    if rollout_logprobs is None:
        return loss, loss_mask, {}
    weight, metrics, loss_mask = off_policy_correction(old_log_probs, rollout_logprobs, loss_mask, cfg)
    if weight is not None:
        loss = loss * weight
    return loss, loss_mask, metrics
