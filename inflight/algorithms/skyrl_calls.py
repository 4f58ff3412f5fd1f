"""The built-in estimators and losses under SkyRL's names, with SkyRL 0.3.0's calling conventions;
`registry.py` registers them (by path, with what each loss needs).

A policy loss here reads `config` (`trainer.algorithm`: `eps_clip_low/high`, `clip_ratio_c`, `cispo.*`,
`sapo.*`, `dppo.*`, `clip_cov.*`, `kl_cov.*`, `off_policy_correction.*`), computes the per-token loss,
applies the off-policy correction against `rollout_logprobs` (when given) and returns
(sum(loss * corrected mask), metrics): SkyRL's final scalar for the advantages it is given, so pass
advantages already scaled by `reductions.scale_advantages`. `loss_mask=None` means every token.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch

from inflight.algorithms import advantages as adv
from inflight.algorithms import cov_losses, policy_losses
from inflight.algorithms.masked import reduce_loss
from inflight.algorithms.off_policy import OffPolicyCorrection, apply_off_policy_correction
from inflight.algorithms.registry import get_advantage_estimator, policy_loss_traits

LossOut = tuple[torch.Tensor, dict[str, Any]]


# ---- advantage estimators: fn(*, token_level_rewards, response_mask, index, values, gamma, lambd,
# grpo_norm_by_std, config, **kwargs) ---------------------------------------------------------------
def grpo(
    *,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Sequence[Hashable],
    grpo_norm_by_std: bool = True,
    epsilon: float = 1e-6,
    **_: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`advantages.grpo_advantages` (`grpo_norm_by_std`)."""
    return adv.grpo_advantages(
        token_level_rewards, response_mask, index, norm_by_std=grpo_norm_by_std, epsilon=epsilon
    )


def rloo(
    *, token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: Sequence[Hashable], **_: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """`advantages.rloo_advantages`."""
    return adv.rloo_advantages(token_level_rewards, response_mask, index)


def maxrl(
    *,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Sequence[Hashable],
    epsilon: float = 1e-6,
    **_: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`advantages.maxrl_advantages`."""
    return adv.maxrl_advantages(token_level_rewards, response_mask, index, epsilon=epsilon)


def reinforce_plus_plus(
    *, token_level_rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float = 1.0, **_: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """`advantages.reinforce_plus_plus_advantages` (`gamma`)."""
    return adv.reinforce_plus_plus_advantages(token_level_rewards, response_mask, gamma=gamma)


def gae(
    *,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    values: torch.Tensor | None = None,
    gamma: float = 1.0,
    lambd: float = 1.0,
    **_: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`advantages.gae_advantages` (`values` from the critic, `gamma`, `lambd`)."""
    return adv.gae_advantages(token_level_rewards, values, response_mask, gamma=gamma, lambd=lambd)


def no_op(*, token_level_rewards: torch.Tensor, **_: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The token rewards as advantages and returns (what SkyRL's on-policy distillation example
    registers as `no_op`: its rewards are already per-token advantages)."""
    return token_level_rewards, token_level_rewards


def compute_advantages_and_returns(
    estimator: str,
    *,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Sequence[Hashable],
    config: Any = None,
    values: torch.Tensor | None = None,
    grpo_norm_by_std: bool = True,
    gamma: float = 1.0,
    lambd: float = 1.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Look `estimator` up and call it as SkyRL's `compute_advantages_and_returns` does. A trainer should
    look it up once (`registry.get_advantage_estimator`) and call the callable the same way."""
    return get_advantage_estimator(estimator)(
        token_level_rewards=token_level_rewards,
        response_mask=response_mask,
        index=index,
        values=values,
        grpo_norm_by_std=grpo_norm_by_std,
        gamma=gamma,
        lambd=lambd,
        config=config,
        **kwargs,
    )


# ---- policy losses: fn(log_probs, old_log_probs, advantages, config, loss_mask=None,
# rollout_logprobs=None) -> (loss, metrics) ------------------------------------------------------------
def _mask(loss_mask: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    return torch.ones_like(like) if loss_mask is None else loss_mask


def _finish(
    name: str,
    out: tuple[torch.Tensor, dict[str, Any]],
    old_log_probs: torch.Tensor | None,
    rollout_logprobs: torch.Tensor | None,
    loss_mask: torch.Tensor,
    config: Any,
) -> LossOut:
    loss, metrics = out
    correction = OffPolicyCorrection.from_config(config.off_policy_correction)
    if not policy_loss_traits(name).applies_off_policy_correction:
        if correction.enabled:
            raise ValueError(
                f"policy_loss_type={name} does not apply trainer.algorithm.off_policy_correction (SkyRL "
                "computes it without); turn the correction off or pick another loss"
            )
        return reduce_loss(loss, loss_mask), metrics
    if correction.enabled and rollout_logprobs is not None and old_log_probs is None:
        raise ValueError(
            "trainer.algorithm.off_policy_correction compares the old log-probs with the rollout's: compute "
            f"the old log-probs for policy_loss_type={name} when a correction is on"
        )
    loss, loss_mask, extra = apply_off_policy_correction(
        loss, old_log_probs, rollout_logprobs, loss_mask, correction
    )
    metrics.update(extra)
    return reduce_loss(loss, loss_mask), metrics


Compute = Callable[
    [torch.Tensor, "torch.Tensor | None", "torch.Tensor | None", torch.Tensor, "torch.Tensor | None", Any],
    tuple[torch.Tensor, dict[str, Any]],
]


def _policy_loss(name: str) -> Callable[[Compute], Callable[..., LossOut]]:
    """`compute(log_probs, old_log_probs, advantages, mask, rollout_logprobs, config)` as the policy
    loss `name` with SkyRL's call (the mask defaulted, the off-policy correction applied unless the
    loss's registered traits say it applies none)."""

    def register(compute: Compute) -> Callable[..., LossOut]:
        def loss(
            log_probs: torch.Tensor,
            old_log_probs: torch.Tensor | None,
            advantages: torch.Tensor | None,
            config: Any,
            loss_mask: torch.Tensor | None = None,
            rollout_logprobs: torch.Tensor | None = None,
        ) -> LossOut:
            mask = _mask(loss_mask, log_probs)
            out = compute(log_probs, old_log_probs, advantages, mask, rollout_logprobs, config)
            return _finish(name, out, old_log_probs, rollout_logprobs, mask, config)

        loss.__name__ = loss.__qualname__ = name
        loss.__doc__ = compute.__doc__
        return loss

    return register


@_policy_loss("regular")
def regular(log_probs, old_log_probs, advantages, mask, _rollout, config):
    """PPO-clip (`policy_losses.ppo_clip_loss`): eps_clip_low, eps_clip_high."""
    return policy_losses.ppo_clip_loss(log_probs, old_log_probs, advantages, mask,
                                       eps_clip_low=config.eps_clip_low, eps_clip_high=config.eps_clip_high)


@_policy_loss("dual_clip")
def dual_clip(log_probs, old_log_probs, advantages, mask, _rollout, config):
    """Dual-clip PPO (`policy_losses.ppo_clip_loss`): eps_clip_low, eps_clip_high, clip_ratio_c."""
    return policy_losses.ppo_clip_loss(log_probs, old_log_probs, advantages, mask,
                                       eps_clip_low=config.eps_clip_low, eps_clip_high=config.eps_clip_high,
                                       clip_ratio_c=config.clip_ratio_c)


@_policy_loss("gspo")
def gspo(log_probs, old_log_probs, advantages, mask, _rollout, config):
    """GSPO-token (`policy_losses.gspo_loss`): eps_clip_low, eps_clip_high."""
    return policy_losses.gspo_loss(log_probs, old_log_probs, advantages, mask,
                                   eps_clip_low=config.eps_clip_low, eps_clip_high=config.eps_clip_high)


@_policy_loss("cispo")
def cispo(log_probs, old_log_probs, advantages, mask, rollout_logprobs, config):
    """CISPO (`policy_losses.cispo_loss`): cispo.cispo_eps_clip_low/high, cispo.cispo_anchor ('old' or
    'rollout'; 'rollout' needs rollout log-probs and refuses TIS, which would count the correction twice)."""
    anchor = getattr(config.cispo, "cispo_anchor", "old")
    if anchor == "rollout":
        if rollout_logprobs is None:
            raise ValueError("cispo_anchor='rollout' needs the rollout log-probs of the batch")
        if config.off_policy_correction.tis_ratio_type is not None:
            raise ValueError(
                "cispo_anchor='rollout' is already the off-policy correction; TIS (off_policy_correction."
                f"tis_ratio_type={config.off_policy_correction.tis_ratio_type!r}) would count it twice: "
                "unset it"
            )
        behavior = rollout_logprobs
    elif anchor == "old":
        behavior = old_log_probs
    else:
        raise ValueError(f"trainer.algorithm.cispo.cispo_anchor={anchor!r}: use 'old' or 'rollout'")
    return policy_losses.cispo_loss(log_probs, behavior, advantages, mask,
                                    eps_clip_low=config.cispo.cispo_eps_clip_low,
                                    eps_clip_high=config.cispo.cispo_eps_clip_high)


@_policy_loss("rollout_is")
def rollout_is(log_probs, _old, advantages, mask, rollout_logprobs, config):
    """Rollout-IS (`policy_losses.rollout_is_loss`): eps_clip_low, eps_clip_high; needs rollout log-probs."""
    if rollout_logprobs is None:
        raise ValueError("policy_loss_type=rollout_is needs the rollout log-probs of the batch")
    return policy_losses.rollout_is_loss(log_probs, rollout_logprobs, advantages, mask,
                                         eps_clip_low=config.eps_clip_low, eps_clip_high=config.eps_clip_high)


@_policy_loss("dppo")
def dppo(log_probs, old_log_probs, advantages, mask, rollout_logprobs, config):
    """DPPO (`policy_losses.dppo_loss`): dppo.dppo_type, dppo.delta_low, dppo.delta_high; against the
    rollout log-probs when given, else the old ones."""
    behavior = rollout_logprobs if rollout_logprobs is not None else old_log_probs
    return policy_losses.dppo_loss(log_probs, behavior, advantages, mask, dppo_type=config.dppo.dppo_type,
                                   delta_low=config.dppo.delta_low, delta_high=config.dppo.delta_high)


@_policy_loss("sapo")
def sapo(log_probs, old_log_probs, advantages, mask, _rollout, config):
    """SAPO (`policy_losses.sapo_loss`): sapo.tau_pos, sapo.tau_neg."""
    return policy_losses.sapo_loss(log_probs, old_log_probs, advantages, mask,
                                   tau_pos=config.sapo.tau_pos, tau_neg=config.sapo.tau_neg)


@_policy_loss("clip_cov")
def clip_cov(log_probs, old_log_probs, advantages, mask, _rollout, config):
    """Clip-Cov (`cov_losses.clip_cov_loss`): eps_clip_low/high, clip_cov.clip_ratio, clip_cov.clip_cov_lb,
    clip_cov.clip_cov_ub."""
    return cov_losses.clip_cov_loss(
        log_probs,
        old_log_probs,
        advantages,
        mask,
        eps_clip_low=config.eps_clip_low,
        eps_clip_high=config.eps_clip_high,
        clip_ratio=config.clip_cov.clip_ratio,
        clip_cov_lb=config.clip_cov.clip_cov_lb,
        clip_cov_ub=config.clip_cov.clip_cov_ub,
    )


@_policy_loss("kl_cov")
def kl_cov(log_probs, old_log_probs, advantages, mask, _rollout, config):
    """KL-Cov (`cov_losses.kl_cov_loss`): kl_cov.kl_cov_frac, kl_cov.ppo_kl_coef."""
    return cov_losses.kl_cov_loss(
        log_probs,
        old_log_probs,
        advantages,
        mask,
        kl_cov_frac=config.kl_cov.kl_cov_frac,
        ppo_kl_coef=config.kl_cov.ppo_kl_coef,
    )


@_policy_loss("cross_entropy")
def cross_entropy(log_probs, _old, _advantages, mask, _rollout, _config):
    """Supervised NLL (`policy_losses.cross_entropy_loss`), summed: reads no advantage."""
    return policy_losses.cross_entropy_loss(log_probs, mask)


@_policy_loss("importance_sampling")
def importance_sampling(log_probs, old_log_probs, advantages, mask, _rollout, _config):
    """Importance-weighted policy gradient (`policy_losses.importance_sampling_loss`)."""
    return policy_losses.importance_sampling_loss(log_probs, old_log_probs, advantages, mask)
