"""RL algorithms as pure tensor functions: SkyRL 0.3.0's `trainer.algorithm.*`, checked against SkyRL's
and verl's own functions (tests/algorithms). Imports only torch and the standard library.

Tensors are [B, T] over response positions, with explicit masks (1 = the token counts) and group ids.

- `advantages`: grpo, rloo, maxrl, reinforce++, gae estimators (and `no_op`, the token rewards as
  they are, in `skyrl_calls`); `batch_normalize_advantages`
  (`advantage_batch_normalize`).
- `groups`: group ids -> rows, `prompt_boundaries`, `zero_variance_filter`, `episode_rows` (step-wise).
- `reductions`: `scale_advantages` / `scale_minibatch_advantages` for each `loss_reduction`
  (token_mean, token_mean_legacy, sequence_mean, seq_mean_token_sum_norm, prompt_mean).
- `policy_losses`: PPO-clip and dual-clip, GSPO, SAPO, CISPO, rollout-IS, DPPO, importance sampling,
  cross entropy; `cov_losses`: Clip-Cov, KL-Cov. Per-token losses with their metrics.
- `off_policy`: `OffPolicyCorrection` (TIS token/sequence, outlier/token/sequence masks).
- `kl`: k1/abs/k2/k3 estimators, the KL loss, KL in the reward, fixed/adaptive KL controllers.
- `entropy`: token entropy from logits (whole or chunked), the entropy bonus and SkyRL's weights of it.
- `value`: the clipped critic loss.
- `registry`: advantage estimators and policy losses by SkyRL name or `package.module:name`, each loss
  with what it needs (`PolicyLossTraits`); `skyrl_calls` holds the built-ins with SkyRL's calling
  conventions, which the registry registers by path.

The names below are imported when first used (PEP 562), so `inflight.algorithms.registry` loads
without torch: validating a config reads the registry.
"""

from __future__ import annotations

import importlib
from typing import Any

_FROM: dict[str, tuple[str, ...]] = {
    "skyrl_calls": ("compute_advantages_and_returns",),
    "advantages": (
        "batch_normalize_advantages",
        "gae_advantages",
        "grpo_advantages",
        "maxrl_advantages",
        "reinforce_plus_plus_advantages",
        "rloo_advantages",
    ),
    "cov_losses": ("clip_cov_loss", "kl_cov_loss"),
    "entropy": (
        "chunked_entropy_from_logits",
        "entropy_from_logits",
        "entropy_loss_term",
        "entropy_token_weights",
    ),
    "groups": ("episode_rows", "group_rows", "prompt_boundaries", "zero_variance_filter"),
    "kl": (
        "KL_ESTIMATORS",
        "AdaptiveKLController",
        "FixedKLController",
        "approx_kl",
        "kl_loss",
        "kl_penalized_rewards",
        "make_kl_controller",
    ),
    "masked": ("masked_mean", "masked_var", "masked_whiten", "reduce_loss", "safe_exp"),
    "off_policy": ("OffPolicyCorrection", "apply_off_policy_correction", "off_policy_correction"),
    "policy_losses": (
        "cispo_loss",
        "cross_entropy_loss",
        "dppo_loss",
        "gspo_loss",
        "importance_sampling_loss",
        "ppo_clip_loss",
        "rollout_is_loss",
        "sapo_loss",
    ),
    "reductions": ("LOSS_REDUCTIONS", "scale_advantages", "scale_minibatch_advantages"),
    "registry": (
        "ADVANTAGE_ESTIMATORS",
        "POLICY_LOSSES",
        "PolicyLossTraits",
        "Registry",
        "get_advantage_estimator",
        "get_policy_loss",
        "policy_loss_traits",
        "register_advantage_estimator",
        "register_policy_loss",
    ),
    "value": ("value_loss",),
}
_MODULE_OF = {name: module for module, names in _FROM.items() for name in names}

__all__ = sorted([*_MODULE_OF, "skyrl_calls"])


def __getattr__(name: str) -> Any:
    if name == "skyrl_calls":
        return importlib.import_module(f"{__name__}.skyrl_calls")
    if name not in _MODULE_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_MODULE_OF[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
