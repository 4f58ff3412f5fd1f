"""RL objectives: group advantages (GRPO, RLOO), the PPO-clip loss against rollout log-probabilities,
truncated importance sampling (TIS) for stale rollouts, and an optional KL penalty to a reference.

Log-probabilities are [B, T] tensors aligned with `input_ids` (`logprobs[b, t]` scores token t given
the tokens before it; see `inflight.train.losses.token_logprobs`), masked by `loss_mask`.

Off-policy correction. Each generated token was sampled by some weight version (the engine records
it per token). When every token of a batch was sampled by the weights the trainer holds now, the
rollout log-probabilities are the "old" policy of PPO and the ratio is taken against them. When some
were sampled by older weights, the rollout policy and the trainer's policy differ; with `tis` on,
the trainer's own log-probabilities before the update (the proximal policy, one forward without
gradients) become PPO's "old" policy and each token's loss is weighted by the truncated ratio
`min(pi_prox / pi_rollout, cap)` (decoupled PPO, AReaL; truncated IS, Yao et al. 2025): per token
(`tis="token"`) or one weight per sequence, the product over its tokens (`tis="sequence"`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from inflight.train.batch import TrainBatch

ADVANTAGE_ESTIMATORS = ("grpo", "rloo")
TIS_LEVELS = ("none", "token", "sequence")
LOSS_REDUCTIONS = ("token_mean", "sequence_mean", "seq_mean_token_sum_norm")


@dataclass
class RLBatch(TrainBatch):
    """A `TrainBatch` with what the RL loss reads besides advantages and old log-probabilities.

    - `is_weights` [B, T]: truncated importance weights (1 where no correction applies).
    - `ref_logprobs` [B, T]: log-probabilities under the reference policy (KL penalty).
    - `rollout_logprobs` [B, T]: the engine's log-probabilities, kept for metrics.
    - `versions` [B, T]: weight version that sampled each token (-1 on prompt / environment tokens).
    - `token_sum_norm` [B]: the divisor of each sequence's token sum under `seq_mean_token_sum_norm`
      (the longest masked length of its mini-batch), so the loss does not depend on how the
      mini-batch is cut into micro-batches or dealt to ranks; absent: the batch's own longest.
    """

    is_weights: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    rollout_logprobs: torch.Tensor | None = None
    versions: torch.Tensor | None = None
    token_sum_norm: torch.Tensor | None = None


# ---- advantages ----------------------------------------------------------------------------------
def group_advantages(rewards: torch.Tensor, estimator: str = "grpo", norm_by_std: bool = True,
                     eps: float = 1e-6) -> torch.Tensor:
    """Per-sample advantages from [G, n] rewards (G groups of n samples of one prompt each).

    `grpo`: (r - mean(group)) / (std(group) + eps), std unbiased (without `norm_by_std`: r - mean).
    `rloo`: r - mean of the other n - 1 samples = n / (n - 1) * (r - mean).
    A group whose rewards are all equal gets zero advantages (it carries no learning signal).
    """
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [groups, samples], got shape {tuple(rewards.shape)}")
    rewards = rewards.float()
    n = rewards.shape[1]
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    if estimator == "grpo":
        if not norm_by_std or n < 2:
            return centred
        return centred / (rewards.std(dim=1, keepdim=True) + eps)
    if estimator == "rloo":
        if n < 2:
            raise ValueError("rloo needs at least 2 samples per prompt")
        return centred * (n / (n - 1))
    raise ValueError(f"unknown advantage estimator {estimator!r}; use one of {ADVANTAGE_ESTIMATORS}")


def informative_groups(rewards: torch.Tensor) -> torch.Tensor:
    """[G] bool: groups whose rewards are not all equal (zero-advantage groups are dropped)."""
    return (rewards.max(dim=1).values - rewards.min(dim=1).values) > 0


# ---- importance sampling -------------------------------------------------------------------------
def truncated_is_weights(prox_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor,
                         level: str = "token", cap: float = 2.0) -> torch.Tensor:
    """[B, T] weights `min(pi_prox / pi_rollout, cap)` on masked tokens (1 elsewhere).

    `token`: one weight per token. `sequence`: exp(sum of the masked log-ratios) truncated at
    `cap`, the same weight on every token of the sequence. `none`: all ones.
    """
    if level == "none":
        return torch.ones_like(prox_logprobs)
    mask = mask.to(prox_logprobs.dtype)
    log_ratio = (prox_logprobs - rollout_logprobs) * mask
    if level == "token":
        weights = torch.exp(log_ratio).clamp(max=cap)
    elif level == "sequence":
        seq = torch.exp(log_ratio.sum(dim=1).clamp(max=math.log(cap)))
        weights = seq[:, None].expand_as(prox_logprobs)
    else:
        raise ValueError(f"unknown TIS level {level!r}; use one of {TIS_LEVELS}")
    return torch.where(mask > 0, weights, torch.ones_like(weights)).detach()


def importance_stats(prox_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, weights: torch.Tensor, mask: torch.Tensor,
                     cap: float) -> dict[str, float]:
    """Mean/max/min of the raw token ratios pi_prox / pi_rollout over the mask, the mean applied
    weight and the fraction of tokens whose ratio was truncated."""
    keep = mask > 0
    if not keep.any():
        return {}
    raw = torch.exp(prox_logprobs - rollout_logprobs)[keep]
    return {
        "is_ratio_mean": float(raw.mean()),
        "is_ratio_max": float(raw.max()),
        "is_ratio_min": float(raw.min()),
        "is_weight_mean": float(weights[keep].mean()),
        "is_truncated_fraction": float((raw > cap).float().mean()),
    }


# ---- losses --------------------------------------------------------------------------------------
def reduce_loss(values: torch.Tensor, mask: torch.Tensor, reduction: str = "token_mean",
                norm: torch.Tensor | None = None) -> torch.Tensor:
    """`token_mean`: mean over every masked token of the batch. `sequence_mean`: mean over
    sequences of each one's token mean. `seq_mean_token_sum_norm`: mean over sequences of each
    one's token sum divided by `norm` [B] (default: the longest masked length in the batch; Dr. GRPO)."""
    mask = mask.to(values.dtype)
    if reduction == "token_mean":
        return (values * mask).sum() / mask.sum().clamp_min(1.0)
    per_seq_tokens = mask.sum(dim=1)
    rows = per_seq_tokens > 0
    if reduction == "sequence_mean":
        per_seq = (values * mask).sum(dim=1) / per_seq_tokens.clamp_min(1.0)
        return per_seq[rows].sum() / rows.sum().clamp_min(1)
    if reduction == "seq_mean_token_sum_norm":
        divisor = per_seq_tokens.max() if norm is None else norm.to(values.dtype)
        per_seq = (values * mask).sum(dim=1) / divisor.clamp_min(1.0)
        return per_seq[rows].sum() / rows.sum().clamp_min(1)
    raise ValueError(f"unknown loss reduction {reduction!r}; use one of {LOSS_REDUCTIONS}")


def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token KL(pi || ref) estimate `exp(ref - lp) - (ref - lp) - 1` (k3: unbiased, >= 0)."""
    diff = (ref_logprobs - logprobs).clamp(-20.0, 20.0)
    return torch.exp(diff) - diff - 1.0


def ppo_clip_terms(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                   eps_clip_low: float = 0.2,
                   eps_clip_high: float = 0.2) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token PPO surrogate loss `-min(r * A, clip(r) * A)`, the ratio r and a clipped flag."""
    ratio = torch.exp(logprobs - old_logprobs)
    clipped_ratio = ratio.clamp(1.0 - eps_clip_low, 1.0 + eps_clip_high)
    unclipped, clipped = ratio * advantages, clipped_ratio * advantages
    return -torch.minimum(unclipped, clipped), ratio, (clipped < unclipped)


def rl_loss(
    eps_clip_low: float = 0.2,
    eps_clip_high: float = 0.2,
    reduction: str = "token_mean",
    kl_coef: float = 0.0,
    tis: str = "token",
    tis_cap: float = 2.0,
):
    """A `loss_fn(logprobs, batch)` for the policy workers: PPO-clip against `batch.old_logprobs`
    (rollout or proximal log-probabilities), times `batch.is_weights`, reduced per `reduction`,
    plus `kl_coef` * KL to `batch.ref_logprobs` when given. The returned function also records the
    last call's statistics in its `.stats` dict (clip fraction, ratio, KL, importance ratios).

    A batch with `old_logprobs=None` but `rollout_logprobs` set asks for the proximal policy to be
    this very forward (exact when the batch gets a single optimizer step: every micro-batch's
    forward runs on the weights of the step's start): the PPO ratio is then 1 and the truncated
    importance weights `min(pi_prox / pi_rollout, tis_cap)` are computed here, at level `tis`,
    which saves the separate proximal forward."""
    if reduction not in LOSS_REDUCTIONS:
        raise ValueError(f"unknown loss reduction {reduction!r}; use one of {LOSS_REDUCTIONS}")

    def loss_fn(logprobs: torch.Tensor, batch: TrainBatch) -> torch.Tensor:
        if batch.advantages is None:
            raise ValueError("the RL loss needs batch.advantages")
        adv = batch.advantages
        adv = adv[:, None].expand_as(logprobs) if adv.dim() == 1 else adv
        old = batch.old_logprobs if batch.old_logprobs is not None else logprobs.detach()
        per_token, ratio, clipped = ppo_clip_terms(logprobs, old, adv, eps_clip_low, eps_clip_high)
        weights = getattr(batch, "is_weights", None)
        mask = batch.loss_mask
        rollout = getattr(batch, "rollout_logprobs", None)
        tis_stats: dict[str, float] = {}
        if weights is None and batch.old_logprobs is None and rollout is not None and tis != "none":
            weights = truncated_is_weights(logprobs.detach(), rollout, mask, tis, tis_cap)
            tis_stats = importance_stats(logprobs.detach(), rollout, weights, mask, tis_cap)
        if weights is not None:
            per_token = per_token * weights
        stats = tis_stats | {
            "clip_fraction": float(reduce_loss(clipped.float(), mask)),
            "ratio_mean": float(reduce_loss(ratio.detach(), mask)),
            "ratio_max": float(ratio.detach()[mask > 0].max()) if mask.any() else 1.0,
            "ratio_min": float(ratio.detach()[mask > 0].min()) if mask.any() else 1.0,
        }
        ref = getattr(batch, "ref_logprobs", None)
        if kl_coef > 0 and ref is not None:
            kl = kl_k3(logprobs, ref)
            per_token = per_token + kl_coef * kl
            stats["kl"] = float(reduce_loss(kl.detach(), mask))
        loss_fn.stats = stats
        return reduce_loss(per_token, mask, reduction, getattr(batch, "token_sum_norm", None))

    loss_fn.stats = {}
    return loss_fn
