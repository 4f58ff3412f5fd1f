"""KL between the policy and a reference policy: per-token estimators, the KL loss, KL in the reward,
and the KL coefficient controllers (SkyRL 0.3.0's `compute_approx_kl`, `get_kl_controller`, the
worker's KL loss and the trainer's `apply_reward_kl_penalty`).

Estimators of KL(pi || pi_ref) from sampled tokens (Schulman, http://joschu.net/blog/kl-approx.html),
with d = log pi - log pi_ref:

- `k1` (verl: `kl`): d.
- `abs`: |d|.
- `k2` (verl: `mse`): d^2 / 2.
- `k3` (verl: `low_var_kl`): exp(-d) + d - 1, with -d clamped to [-20, 20] and the result to [-10, 10].
"""

from __future__ import annotations

import torch

from inflight.algorithms.masked import masked_mean

KL_ESTIMATORS = ("k1", "abs", "k2", "k3")
_ALIASES = {"kl": "k1", "mse": "k2", "low_var_kl": "k3"}


def kl_estimator_name(name: str) -> str:
    """The canonical estimator `name` stands for (verl's `kl`, `mse`, `low_var_kl` are accepted)."""
    canonical = _ALIASES.get(name, name)
    if canonical not in KL_ESTIMATORS:
        raise ValueError(
            f"trainer.algorithm.kl_estimator_type={name!r} is not a KL estimator: use one of "
            f"{', '.join(KL_ESTIMATORS)} (or verl's {', '.join(_ALIASES)})"
        )
    return canonical


def approx_kl(
    log_probs: torch.Tensor,
    ref_log_probs: torch.Tensor,
    loss_mask: torch.Tensor | None = None,
    estimator: str = "k3",
) -> torch.Tensor:
    """Per-token KL estimate [B, T] (module docstring); with `loss_mask`, kl * mask where the mask is
    nonzero and exactly 0 elsewhere (a NaN at a masked position does not leak)."""
    kind = kl_estimator_name(estimator)
    if kind == "k1":
        kld = log_probs - ref_log_probs
    elif kind == "abs":
        kld = (log_probs - ref_log_probs).abs()
    elif kind == "k2":
        kld = 0.5 * (log_probs - ref_log_probs).square()
    else:
        log_ratio = torch.clamp(ref_log_probs - log_probs, min=-20, max=20)
        kld = torch.clamp(torch.exp(log_ratio) - log_ratio - 1, min=-10, max=10)
    if loss_mask is not None:
        kld = torch.where(loss_mask.bool(), kld * loss_mask, 0.0)
    return kld


def kl_loss(
    log_probs: torch.Tensor, ref_log_probs: torch.Tensor, loss_mask: torch.Tensor, estimator: str = "k3"
) -> torch.Tensor:
    """`use_kl_loss`'s KL term: the mean over rows of each row's masked token mean of `approx_kl`
    (an all-masked row counts as 0 in the mean). The worker adds `kl_loss_coef` times it to the loss
    of each micro-batch, weighted by the micro-batch's share of rows, whatever `loss_reduction` is."""
    kl = approx_kl(log_probs, ref_log_probs, loss_mask, estimator)
    return masked_mean(kl, loss_mask, dim=-1).mean()


@torch.no_grad()
def kl_penalized_rewards(
    token_level_rewards: torch.Tensor,
    log_probs: torch.Tensor,
    ref_log_probs: torch.Tensor,
    loss_mask: torch.Tensor,
    kl_coef: float,
    estimator: str = "k3",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """`use_kl_in_reward`: rewards - kl * max(0, kl_coef), kl = approx_kl(log_probs, ref, loss_mask).

    `log_probs` are the policy's own (the trainer's forward before the update, not the rollout's).
    Metrics (SkyRL's): `avg_kl` (mean over rows of the masked row mean of kl), `avg_kl_max` (mean over
    rows of max |kl|), `kl_loss_coef`. Feed `avg_kl` and B to the controller's `update` afterwards."""
    kl = approx_kl(log_probs, ref_log_probs, loss_mask, estimator)
    rewards = token_level_rewards - kl * max(0, kl_coef)
    metrics = {
        "avg_kl": masked_mean(kl, loss_mask, dim=-1).mean(),
        "avg_kl_max": torch.max(kl.abs(), dim=-1)[0].mean(),
        "kl_loss_coef": torch.tensor(float(kl_coef)),
    }
    return rewards, metrics


class FixedKLController:
    """`kl_ctrl.type=fixed`: the coefficient stays `kl_coef`."""

    def __init__(self, kl_coef: float) -> None:
        self.value = kl_coef

    def update(self, current: float, n_steps: int) -> None:
        """Nothing changes."""


class AdaptiveKLController:
    """`kl_ctrl.type=adaptive` (Ziegler et al. 2019, arXiv:1909.08593): after each batch,
    value *= 1 + clip(current / kl_target - 1, -0.2, 0.2) * n_steps / horizon."""

    def __init__(self, kl_coef: float, kl_target: float, horizon: int) -> None:
        if horizon <= 0:
            raise ValueError(f"trainer.algorithm.kl_ctrl.horizon must be > 0, got {horizon}")
        self.value = kl_coef
        self.target = kl_target
        self.horizon = horizon

    def update(self, current: float, n_steps: int) -> None:
        """`current`: the batch's mean KL (`avg_kl`); `n_steps`: its number of rows (what SkyRL passes)."""
        error = min(max(current / self.target - 1, -0.2), 0.2)
        self.value *= 1 + error * n_steps / self.horizon


def make_kl_controller(
    kind: str, kl_coef: float, kl_target: float = 0.1, horizon: int = 10000
) -> FixedKLController | AdaptiveKLController:
    """The controller `trainer.algorithm.kl_ctrl.type` names, starting at `kl_loss_coef`. SkyRL uses it
    only for `use_kl_in_reward` (the KL loss always uses `kl_loss_coef` as is)."""
    if kind == "fixed":
        return FixedKLController(kl_coef)
    if kind == "adaptive":
        return AdaptiveKLController(kl_coef, kl_target, horizon)
    raise ValueError(f"trainer.algorithm.kl_ctrl.type={kind!r}: use 'fixed' or 'adaptive'")
