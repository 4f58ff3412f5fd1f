"""The RL objective of the training step: `trainer.algorithm.*` resolved once into an `Objective`
(the advantage estimator and policy loss looked up in `inflight.algorithms`' registries, the
off-policy correction, the KL controller), and the loss a policy worker runs on each micro-batch.

Log-probabilities are [B, T] tensors aligned with `input_ids` (`logprobs[b, t]` scores token t given
the tokens before it; see `inflight.train.losses.token_logprobs`), masked by `loss_mask`.

The micro-batch loss is SkyRL 0.3.0's: the policy loss is a SUM over the micro-batch's masked tokens
of the per-token loss with advantages already divided for `loss_reduction` over the whole
mini-batch (`inflight.algorithms.reductions`), so the micro-batches' sums add up to the mini-batch's
mean whatever the cut; the KL loss (a per-row token mean) is weighted by each row's share of its
mini-batch's rows (`RLBatch.row_weight`) and the entropy bonus by SkyRL's weight of the row's tokens
(`RLBatch.token_weight`, `inflight.algorithms.entropy_token_weights`: SkyRL's mean over micro-batches
of `micro_train_batch_size_per_gpu` consecutive rows of their token means), so they too add up to
SkyRL's terms over any cut and any data-parallel dealing. The step multiplies the loss by the
data-parallel size, which the ranks' gradient average divides out again.

Old log-probabilities (PPO's pi_old, the off-policy correction's numerator) are the trainer's policy
when the step starts: a forward without gradients, or, when every forward of the step runs on those
weights (one mini-batch, one epoch), the training forward itself (`RLBatch.old_logprobs=None`: its
detached values), which saves the forward and makes the first ratio exactly 1.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from inflight.algorithms import (
    OffPolicyCorrection,
    PolicyLossTraits,
    approx_kl,
    get_advantage_estimator,
    get_policy_loss,
    make_kl_controller,
    masked_mean,
    policy_loss_traits,
)
from inflight.algorithms.kl import kl_estimator_name
from inflight.config import Config
from inflight.train.batch import TrainBatch


@dataclass
class RLBatch(TrainBatch):
    """A `TrainBatch` with what the RL loss reads besides advantages and old log-probabilities.

    - `advantages` [B, T]: per token, already divided for `loss_reduction` over the row's mini-batch.
    - `old_logprobs` [B, T] or None: the policy at the step's start (None: this very forward is).
    - `rollout_logprobs` [B, T]: the engine's log-probabilities of the sampled tokens.
    - `ref_logprobs` [B, T]: log-probabilities under the reference policy (KL loss).
    - `versions` [B, T]: weight version that sampled each token (-1 on prompt / environment tokens).
    - `row_weight` [B]: 1 / rows of the row's mini-batch (the KL loss is a mean over rows).
    - `token_weight` [B]: the weight of the row's tokens in the entropy (`entropy_token_weights`).
    - `row_index` [B]: each row's place in the step's batch, SkyRL's row order (default: a new batch's
      rows are in it); micro-batches hold rows sorted by length, and the policy loss sees them back in
      this order (kl_cov's top-k and clip_cov's draw break ties by position).
    """

    rollout_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    versions: torch.Tensor | None = None
    row_weight: torch.Tensor | None = None
    token_weight: torch.Tensor | None = None
    row_index: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.row_index is None:
            self.row_index = torch.arange(self.input_ids.shape[0], device=self.input_ids.device)
        super().__post_init__()


def off_policy_correction(cfg: Config) -> OffPolicyCorrection:
    """`trainer.algorithm.off_policy_correction`, with SkyRL's deprecated `use_tis=true` read as it
    reads it: token-level TIS capped at `tis_imp_ratio_cap`."""
    alg = cfg.trainer.algorithm
    correction = OffPolicyCorrection.from_config(alg.off_policy_correction)
    if alg.use_tis:
        correction = dataclasses.replace(correction, tis_ratio_type="token",
                                         token_tis_ratio_clip_high=float(alg.tis_imp_ratio_cap))
    return correction


def training_temperature(cfg: Config) -> float:
    """What the training forwards divide the logits by: `trainer.algorithm.temperature`, null meaning
    the rollouts' `generator.sampling_params.temperature` (greedy counts as 1)."""
    from inflight.engine.request import scaling_temperature

    temperature = cfg.trainer.algorithm.temperature
    return scaling_temperature(
        cfg.generator.sampling_params.temperature if temperature is None else temperature
    )


def uses_reference(cfg: Config) -> bool:
    """Whether the run needs the reference model (`trainer.ref.model.path`, default the policy's
    base): for the KL loss, the KL in the reward or on-policy distillation (the teacher)."""
    alg = cfg.trainer.algorithm
    return alg.use_kl_loss or alg.use_kl_in_reward or alg.on_policy_distillation


@dataclass
class Objective:
    """`trainer.algorithm` resolved for one run: the callables its names select (looked up when the
    step is built, so names a user registered before count), what the loss declared when it was
    registered (`traits`) and the settings the step reads. `config` is what the estimator and the
    loss receive: the `trainer.algorithm` section with the effective off-policy correction and
    temperature (SkyRL's attribute names)."""

    config: Any
    estimator: Callable[..., Any]
    policy_loss: Callable[..., Any]
    correction: OffPolicyCorrection
    kl_controller: Any = None
    traits: PolicyLossTraits = dataclasses.field(default_factory=PolicyLossTraits)

    @classmethod
    def from_config(cls, cfg: Config) -> Objective:
        """The objective `cfg` asks for; ValueError naming the known names when a name is unknown."""
        alg = cfg.trainer.algorithm
        correction = off_policy_correction(cfg)
        config = dataclasses.replace(
            alg,
            off_policy_correction=correction,
            temperature=training_temperature(cfg),
            kl_estimator_type=kl_estimator_name(alg.kl_estimator_type),
        )
        controller = None
        if alg.use_kl_in_reward:
            ctrl = alg.kl_ctrl
            controller = make_kl_controller(ctrl.type, alg.kl_loss_coef, ctrl.kl_target, ctrl.horizon)
        return cls(
            config,
            get_advantage_estimator(alg.advantage_estimator),
            get_policy_loss(alg.policy_loss_type),
            correction,
            controller,
            policy_loss_traits(alg.policy_loss_type),
        )

    @property
    def loss_name(self) -> str:
        return self.config.policy_loss_type

    @property
    def needs_old_logprobs(self) -> bool:
        """Whether anything reads the old log-probabilities: not for the losses registered without
        `needs_old_logprobs` (they read the rollout's, SkyRL's `LOSSES_WITHOUT_OLD_LOGPROBS`) when no
        KL in the reward, no distillation and no off-policy correction needs them either."""
        alg = self.config
        return not (not self.traits.needs_old_logprobs and not alg.use_kl_in_reward
                    and not alg.on_policy_distillation and not self.correction.enabled)

    @property
    def old_logprobs_before_training(self) -> bool:
        """Whether the old log-probabilities are needed before the training passes (they shape the
        rewards: the KL in the reward, on-policy distillation), so the training forward cannot be them."""
        return self.config.use_kl_in_reward or self.config.on_policy_distillation

    def state(self) -> dict[str, float]:
        """What a checkpoint keeps: the KL controller's coefficient."""
        return {} if self.kl_controller is None else {"kl_coef": float(self.kl_controller.value)}

    def load_state(self, state: dict[str, Any]) -> None:
        if self.kl_controller is not None and "kl_coef" in state:
            self.kl_controller.value = float(state["kl_coef"])


def rl_loss(objective: Objective) -> Callable[..., torch.Tensor]:
    """A `loss_fn(logprobs, batch, entropy=None)` for the policy workers (module docstring); it records
    the last call's statistics: `.stats`, token means over the micro-batch (the loss's own metrics,
    `is_ratio_*` of the old over the rollout log-probabilities), and `.sums`, the micro-batch's part of
    the mini-batch's `kl` (row mean) and `policy_entropy` (SkyRL's mean over its micro-batches).
    `.wants_entropy`: whether the worker must pass the per-token entropy (`use_entropy_loss`)."""
    alg = objective.config
    supervised = objective.traits.supervised  # SkyRL adds no KL or entropy term to it

    def loss_fn(logprobs: torch.Tensor, batch: RLBatch, entropy: torch.Tensor | None = None) -> torch.Tensor:
        mask = batch.loss_mask
        old = batch.old_logprobs if batch.old_logprobs is not None else logprobs.detach()
        rollout = batch.rollout_logprobs
        o = in_batch_order(batch.row_index)
        total, metrics = objective.policy_loss(o(logprobs), o(old) if objective.needs_old_logprobs else None,
                                               o(batch.advantages), alg, loss_mask=o(mask),
                                               rollout_logprobs=o(rollout))
        stats = {key: float(value) for key, value in metrics.items()}
        if rollout is not None:
            stats.update(ratio_stats(old, rollout, mask))
        sums = {}
        if not supervised and alg.use_kl_loss and batch.ref_logprobs is not None:
            kl = masked_mean(
                approx_kl(logprobs, batch.ref_logprobs, mask, alg.kl_estimator_type), mask, dim=-1
            )
            term = (kl * batch.row_weight).sum()
            total = total + alg.kl_loss_coef * term
            sums["kl"] = float(term.detach())
        if not supervised and entropy is not None:
            term = (entropy * mask * batch.token_weight[:, None]).sum()
            total = total - alg.entropy_loss_coef * term
            sums["policy_entropy"] = float(term.detach())
        loss_fn.stats, loss_fn.sums = stats, sums
        return total

    loss_fn.stats, loss_fn.sums = {}, {}
    loss_fn.wants_entropy = bool(alg.use_entropy_loss) and not supervised
    return loss_fn


def in_batch_order(row_index: torch.Tensor | None) -> Callable[[torch.Tensor | None], torch.Tensor | None]:
    """A function putting a micro-batch's [B, ...] tensors' rows in the order of `row_index` (the
    step's batch order); the identity when they are in it already."""
    if row_index is None or len(row_index) < 2 or bool((row_index[1:] > row_index[:-1]).all()):
        return lambda tensor: tensor
    order = torch.argsort(row_index, stable=True)
    return lambda tensor: None if tensor is None else tensor[order.to(tensor.device)]


def ratio_stats(old: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """Mean / max / min over the masked tokens of pi_old / pi_rollout (the trainer's policy at the
    step's start against the engine's), the ratio the off-policy correction works on."""
    keep = mask > 0
    if not keep.any():
        return {}
    ratio = torch.exp((old.detach() - rollout)[keep].clamp(-20, 20))
    return {"is_ratio_mean": float(ratio.mean()), "is_ratio_max": float(ratio.max()),
            "is_ratio_min": float(ratio.min())}
