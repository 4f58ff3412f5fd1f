"""The RL objective (SkyRL: `trainer.algorithm`): advantages, the policy loss and its reduction,
KL terms, entropy, off-policy correction, dynamic sampling."""

from __future__ import annotations

from dataclasses import dataclass, field

from inflight.config.status import example, ours, skyrl


@dataclass
class KLCtrlConfig:
    """The controller of the KL coefficient in the reward (`use_kl_in_reward`)."""

    type: str = skyrl("fixed", choices=("fixed", "adaptive"))
    """`fixed` (default: the coefficient stays `kl_loss_coef`) or `adaptive` (Ziegler et al. 2019:
    moved toward `kl_target` over `horizon` samples)."""
    kl_target: float = skyrl(0.1)
    """Target KL of the adaptive controller. Default 0.1."""
    horizon: int = skyrl(10000)
    """Samples over which the adaptive controller closes the gap to the target. Default 10000."""


@dataclass
class SAPOConfig:
    """Soft adaptive policy optimisation (`policy_loss_type=sapo`)."""

    tau_pos: float = skyrl(1.0)
    """Temperature of the soft gate for positive advantages. Default 1.0."""
    tau_neg: float = skyrl(1.05)
    """Temperature of the soft gate for negative advantages. Default 1.05."""


@dataclass
class DynamicSamplingConfig:
    """DAPO's dynamic sampling: groups whose rewards are all equal carry no signal."""

    type: str | None = skyrl(None)
    """`filter` (drop such groups and sample more prompts until the batch is full), `replace`
    (replace them by copies of informative groups; synchronous trainer only), or null (default: off).
    In the fully-async trainer `filter` is `trainer.fully_async.sample_full_batch`."""
    max_sample_batches: int = skyrl(30)
    """Most batches the synchronous trainer samples to fill one training batch (more is an error); -1:
    no limit. Default 30."""
    min_replace_ratio: float = skyrl(0.3)
    """`replace`: the least share of informative groups a batch needs before the rest are replaced
    by copies of them. Default 0.3."""


@dataclass
class ClipCovConfig:
    """Clip-Cov (`policy_loss_type=clip_cov`, Cui et al. 2025)."""

    clip_ratio: float = skyrl(0.0002)
    """Share of tokens, by covariance, whose gradient is cut. Default 0.0002."""
    clip_cov_lb: float = skyrl(1.0)
    """Lower covariance bound of the tokens that may be cut. Default 1.0."""
    clip_cov_ub: float = skyrl(5.0)
    """Upper covariance bound of the tokens that may be cut. Default 5.0."""


@dataclass
class KLCovConfig:
    """KL-Cov (`policy_loss_type=kl_cov`, Cui et al. 2025)."""

    kl_cov_frac: float = skyrl(0.2)
    """Share of tokens, by covariance, that get the KL penalty. Default 0.2."""
    ppo_kl_coef: float = skyrl(1.0)
    """Weight of that penalty. Default 1.0."""


@dataclass
class CISPOConfig:
    """CISPO (`policy_loss_type=cispo`, MiniMax-M1): clipped importance weights, no token dropped."""

    cispo_eps_clip_low: float = skyrl(0.0)
    """The importance ratio is clipped below at 1 - this. Default 0.0 (SkyRL 0.3.0's: the weight is
    at least 1; SkyRL's later default is 1.0)."""
    cispo_eps_clip_high: float = skyrl(5.0)
    """The importance ratio is clipped above at 1 + this. Default 5.0 (SkyRL 0.3.0's; later 4.0)."""
    cispo_anchor: str = skyrl("old", choices=("old", "rollout"))
    """The behaviour policy of the ratio: `old` (default: the old/proximal log-probabilities) or
    `rollout` (the engine's)."""


@dataclass
class DPPOConfig:
    """DPPO (`policy_loss_type=dppo`): a divergence-based trust region."""

    dppo_type: str = skyrl("binary_tv", choices=("binary_tv", "binary_kl"))
    """`binary_tv` (default) or `binary_kl`."""
    delta_low: float = skyrl(0.2)
    """Divergence threshold for negative advantages. Default 0.2."""
    delta_high: float = skyrl(0.2)
    """Divergence threshold for positive advantages. Default 0.2."""


@dataclass
class OffPolicyCorrectionConfig:
    """Importance sampling of tokens the rollout policy sampled (SkyRL:
    `trainer.algorithm.off_policy_correction`); the ratio is pi_old / pi_rollout per token."""

    tis_ratio_type: str | None = skyrl(None)
    """Truncated importance sampling: `token`, `sequence`, or null (default: none)."""
    token_tis_ratio_clip_high: float = skyrl(2.0)
    """Cap of the token-level importance weights (`tis_ratio_type=token`), > 0. Default 2.0."""
    sequence_tis_ratio_clip_high: float = skyrl(5.0)
    """Cap of the sequence-level importance weight (`tis_ratio_type=sequence`), > 0. Default 5.0."""
    sequence_mask_metric: str | None = skyrl(None)
    """Mask whole sequences whose importance ratio leaves a band: `geometric` (the geometric mean of
    the token ratios in [geo_mask_low, geo_mask_high]), `product` (their product in
    [product_mask_low, product_mask_high]) or null (default: no mask)."""
    geo_mask_high: float = skyrl(1.01)
    """Upper bound of the geometric-mean ratio. Default 1.01."""
    geo_mask_low: float = skyrl(0.99)
    """Lower bound of the geometric-mean ratio. Default 0.99."""
    product_mask_high: float = skyrl(2.0)
    """Upper bound of the product ratio. Default 2.0."""
    product_mask_low: float = skyrl(0.5)
    """Lower bound of the product ratio. Default 0.5."""
    outlier_token_is_threshold_low: float | None = skyrl(None)
    """Mask a sequence when any token's ratio is below this; null (default): off."""
    outlier_token_is_threshold_high: float | None = skyrl(None)
    """Mask a sequence when any token's ratio is above this; null (default): off."""
    token_mask_is_threshold_low: float | None = skyrl(None)
    """Mask a token whose ratio is below this; null (default): off."""
    token_mask_is_threshold_high: float | None = skyrl(None)
    """Mask a token whose ratio is above this; null (default): off."""


@dataclass
class AlgorithmConfig:
    """The RL objective."""

    advantage_estimator: str = skyrl("grpo")
    """`grpo` (default), `rloo`, `reinforce++`, `gae` (needs `trainer.critic.model.path`), `maxrl`,
    `no_op` (the token rewards as advantages), a name given to `register_advantage_estimator`
    (`inflight.algorithms`) before the run starts, or `package.module:name`."""
    kl_ctrl: KLCtrlConfig = field(default_factory=KLCtrlConfig)
    kl_estimator_type: str = skyrl("k3", choices=("k1", "k2", "k3", "abs"))
    """Per-token KL estimate to the reference: `k1`, `k2`, `k3` (default), `abs`
    (http://joschu.net/blog/kl-approx.html)."""
    use_kl_in_reward: bool = skyrl(False)
    """Subtract the coefficient (`kl_ctrl`) times the KL to the reference from the token rewards.
    Excludes use_kl_loss. Default false."""
    use_kl_loss: bool = skyrl(True)
    """Add `kl_loss_coef` times the KL to the reference to the loss. Default true."""
    kl_loss_coef: float = skyrl(0.001)
    """Weight of the KL loss (and the fixed / initial coefficient of the KL in the reward), >= 0.
    Default 0.001."""
    use_entropy_loss: bool = skyrl(False)
    """Subtract `entropy_loss_coef` times the policy's token entropy from the loss. Default false."""
    entropy_loss_coef: float = skyrl(0.01)
    """Weight of the entropy bonus. Default 0.01."""
    temperature: float | None = skyrl(None)
    """Temperature the training forward divides the logits by; null (default): the rollouts'
    `generator.sampling_params.temperature` (so trainer and engine score the same distribution)."""
    advantage_batch_normalize: bool = skyrl(False)
    """Whiten the advantages over the batch's masked tokens. Default false."""
    value_head_prefix: str = skyrl("value_head")
    """Name of the critic's value head in its checkpoint. Default value_head."""
    policy_loss_type: str = skyrl("regular")
    """`regular` (PPO clip, default), `dual_clip`, `gspo`, `cispo`, `sapo`, `clip_cov`, `kl_cov`,
    `rollout_is`, `dppo`, `cross_entropy`, `importance_sampling`, a name given to
    `register_policy_loss` (`inflight.algorithms`) before the run starts, or `package.module:name`."""
    loss_reduction: str = skyrl("token_mean", choices=(
        "token_mean", "token_mean_legacy", "sequence_mean", "prompt_mean", "seq_mean_token_sum_norm"))
    """`token_mean` (default), `token_mean_legacy`, `sequence_mean`, `prompt_mean` or
    `seq_mean_token_sum_norm` (Dr. GRPO: needs `max_seq_len`)."""
    grpo_norm_by_std: bool = skyrl(True)
    """Divide GRPO advantages by the group's reward std. Default true."""
    zero_variance_filter: bool = skyrl(False)
    """Leave groups whose rewards are all equal (within zero_variance_filter_tol) out of the loss.
    Default false."""
    zero_variance_filter_tol: float = skyrl(1e-6)
    """Rewards within this absolute tolerance count as equal. Default 1e-6."""
    lambd: float = skyrl(1.0)
    """GAE's lambda. Default 1.0."""
    gamma: float = skyrl(1.0)
    """Discount of GAE and REINFORCE++. Default 1.0."""
    eps_clip_low: float = skyrl(0.2)
    """PPO ratio clip below 1, >= 0. Default 0.2."""
    eps_clip_high: float = skyrl(0.2)
    """PPO ratio clip above 1, >= 0. Default 0.2."""
    clip_ratio_c: float = skyrl(3.0)
    """Dual-clip bound of negative-advantage tokens (`dual_clip`), > 1. Default 3.0."""
    tis_imp_ratio_cap: float = skyrl(-1.0)
    """Deprecated (SkyRL): the cap of `use_tis`'s token-level TIS (> 0). Default -1."""
    use_tis: bool = skyrl(False)
    """Deprecated (SkyRL): true means off_policy_correction.tis_ratio_type=token with
    token_tis_ratio_clip_high=tis_imp_ratio_cap, as SkyRL reads it. Default false."""
    off_policy_correction: OffPolicyCorrectionConfig = field(default_factory=OffPolicyCorrectionConfig)
    sapo: SAPOConfig = field(default_factory=SAPOConfig)
    value_clip: float = skyrl(0.2)
    """Clip of the critic's value updates (`gae`). Default 0.2."""
    dynamic_sampling: DynamicSamplingConfig = field(default_factory=DynamicSamplingConfig)
    clip_cov: ClipCovConfig = field(default_factory=ClipCovConfig)
    kl_cov: KLCovConfig = field(default_factory=KLCovConfig)
    cispo: CISPOConfig = field(default_factory=CISPOConfig)
    dppo: DPPOConfig = field(default_factory=DPPOConfig)
    max_seq_len: int | None = skyrl(None)
    """The divisor of `seq_mean_token_sum_norm` (the longest response any batch can hold); null
    (default) is refused with that reduction."""
    overlong_buffer_len: int | None = example(None)
    """DAPO's soft overlong punishment (the key of SkyRL's DAPO example): a response longer than
    generator.sampling_params.max_generate_length - this has (length - that) / this *
    overlong_buffer_penalty_factor subtracted from its reward; one longer than max_generate_length
    scores 0. Null (default): off."""
    overlong_buffer_penalty_factor: float = example(1.0)
    """The penalty of a response that fills the whole overlong buffer, >= 0. Default 1.0."""
    on_policy_distillation: bool = ours(False)
    """On-policy distillation as SkyRL's example runs it: the reference (`trainer.ref.model.path`) is
    the teacher and each token's reward is -(log pi(token) - log pi_teacher(token)) under the policy
    at the step's start, in place of the task's reward; pair it with `advantage_estimator=no_op` (the
    token rewards are the advantages) and e.g. `policy_loss_type=importance_sampling`. Excludes
    use_kl_in_reward. Default false."""
