"""RL algorithms as pure tensor functions: SkyRL 0.3.0's `trainer.algorithm.*`, checked against SkyRL's
and verl's own functions (tests/algorithms). Imports only torch and the standard library.

Tensors are [B, T] over response positions, with explicit masks (1 = the token counts) and group ids.

- `advantages`: grpo, rloo, maxrl, reinforce++, gae estimators (and `no_op`, the token rewards as
  they are, in `adapters`); `batch_normalize_advantages`
  (`advantage_batch_normalize`).
- `groups`: group ids -> rows, `prompt_boundaries`, `zero_variance_filter`.
- `reductions`: `scale_advantages` / `scale_minibatch_advantages` for each `loss_reduction`
  (token_mean, token_mean_legacy, sequence_mean, seq_mean_token_sum_norm, prompt_mean).
- `policy_losses`: PPO-clip and dual-clip, GSPO, SAPO, CISPO, rollout-IS, DPPO, importance sampling,
  cross entropy; `cov_losses`: Clip-Cov, KL-Cov. Per-token losses with their metrics.
- `off_policy`: `OffPolicyCorrection` (TIS token/sequence, outlier/token/sequence masks).
- `kl`: k1/abs/k2/k3 estimators, the KL loss, KL in the reward, fixed/adaptive KL controllers.
- `entropy`: token entropy from logits (whole or chunked), the entropy bonus and SkyRL's weights of it.
- `value`: the clipped critic loss.
- `registry`: advantage estimators and policy losses by SkyRL name or `package.module:name`;
  `adapters` registers the built-ins with SkyRL's calling conventions.
"""

from inflight.algorithms import adapters
from inflight.algorithms.adapters import (
    LOSSES_WITHOUT_OFF_POLICY_CORRECTION,
    LOSSES_WITHOUT_OLD_LOGPROBS,
    compute_advantages_and_returns,
)
from inflight.algorithms.advantages import (
    batch_normalize_advantages,
    gae_advantages,
    grpo_advantages,
    maxrl_advantages,
    reinforce_plus_plus_advantages,
    rloo_advantages,
)
from inflight.algorithms.cov_losses import clip_cov_loss, kl_cov_loss
from inflight.algorithms.entropy import (
    chunked_entropy_from_logits,
    entropy_from_logits,
    entropy_loss_term,
    entropy_token_weights,
)
from inflight.algorithms.groups import group_rows, prompt_boundaries, zero_variance_filter
from inflight.algorithms.kl import (
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    approx_kl,
    kl_loss,
    kl_penalized_rewards,
    make_kl_controller,
)
from inflight.algorithms.masked import masked_mean, masked_var, masked_whiten, reduce_loss, safe_exp
from inflight.algorithms.off_policy import (
    OffPolicyCorrection,
    apply_off_policy_correction,
    off_policy_correction,
)
from inflight.algorithms.policy_losses import (
    cispo_loss,
    cross_entropy_loss,
    dppo_loss,
    gspo_loss,
    importance_sampling_loss,
    ppo_clip_loss,
    rollout_is_loss,
    sapo_loss,
)
from inflight.algorithms.reductions import LOSS_REDUCTIONS, scale_advantages, scale_minibatch_advantages
from inflight.algorithms.registry import (
    ADVANTAGE_ESTIMATORS,
    POLICY_LOSSES,
    Registry,
    get_advantage_estimator,
    get_policy_loss,
    register_advantage_estimator,
    register_policy_loss,
)
from inflight.algorithms.value import value_loss

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "KL_ESTIMATORS",
    "LOSSES_WITHOUT_OFF_POLICY_CORRECTION",
    "LOSSES_WITHOUT_OLD_LOGPROBS",
    "LOSS_REDUCTIONS",
    "POLICY_LOSSES",
    "AdaptiveKLController",
    "FixedKLController",
    "OffPolicyCorrection",
    "Registry",
    "adapters",
    "apply_off_policy_correction",
    "approx_kl",
    "batch_normalize_advantages",
    "chunked_entropy_from_logits",
    "cispo_loss",
    "clip_cov_loss",
    "compute_advantages_and_returns",
    "cross_entropy_loss",
    "dppo_loss",
    "entropy_from_logits",
    "entropy_loss_term",
    "entropy_token_weights",
    "gae_advantages",
    "get_advantage_estimator",
    "get_policy_loss",
    "group_rows",
    "grpo_advantages",
    "gspo_loss",
    "importance_sampling_loss",
    "kl_cov_loss",
    "kl_loss",
    "kl_penalized_rewards",
    "make_kl_controller",
    "masked_mean",
    "masked_var",
    "masked_whiten",
    "maxrl_advantages",
    "off_policy_correction",
    "ppo_clip_loss",
    "prompt_boundaries",
    "reduce_loss",
    "register_advantage_estimator",
    "register_policy_loss",
    "reinforce_plus_plus_advantages",
    "rloo_advantages",
    "rollout_is_loss",
    "safe_exp",
    "sapo_loss",
    "scale_advantages",
    "scale_minibatch_advantages",
    "value_loss",
    "zero_variance_filter",
]
