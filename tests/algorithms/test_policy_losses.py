"""Every policy loss, as the registry gives it, against SkyRL 0.3.0's registered function: the final
scalar and its gradient for every (policy_loss_type, loss_reduction) pair, the metrics, the off-policy
correction inside; and against verl 0.9.1's twin where the formula is the same."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from algorithm_batches import TOL, assert_metrics_close, make_batch

from inflight.algorithms import (
    cov_losses,
    get_policy_loss,
    groups,
    policy_loss_traits,
    policy_losses,
    scale_advantages,
)
from inflight.config import Config

LOSSES = (
    "regular",
    "dual_clip",
    "gspo",
    "cispo",
    "rollout_is",
    "dppo",
    "sapo",
    "clip_cov",
    "kl_cov",
    "cross_entropy",
    "importance_sampling",
)
WITH_CORRECTION = tuple(name for name in LOSSES if policy_loss_traits(name).applies_off_policy_correction)
WITHOUT_CORRECTION = tuple(name for name in LOSSES if name not in WITH_CORRECTION)
SIZES = (1, 3, 4, 2, 6)
CISPO_EXTRA = ("cispo/ratio_mean", "cispo/ratio_clamped_mean", "cispo/ratio_max", "cispo/ratio_min")
CORRECTIONS = {
    "token_tis": dict(tis_ratio_type="token", token_tis_ratio_clip_high=1.5),
    "seq_tis_geo": dict(
        tis_ratio_type="sequence",
        sequence_tis_ratio_clip_high=3.0,
        sequence_mask_metric="geometric",
        geo_mask_high=1.1,
        geo_mask_low=0.9,
    ),
    "product_outlier": dict(
        sequence_mask_metric="product",
        product_mask_high=4.0,
        product_mask_low=0.25,
        outlier_token_is_threshold_high=3.0,
    ),
    "token_masks": dict(
        tis_ratio_type="token",
        token_tis_ratio_clip_high=1.2,
        outlier_token_is_threshold_low=0.45,
        token_mask_is_threshold_low=0.6,
        token_mask_is_threshold_high=1.8,
    ),
}


def skyrl_config(skyrl, name: str, dppo_type: str = "binary_tv", **correction):
    c = skyrl.config
    return c.AlgorithmConfig(
        policy_loss_type=name,
        eps_clip_low=0.2,
        eps_clip_high=0.28,
        clip_ratio_c=3.0,
        cispo=c.CISPOConfig(cispo_eps_clip_low=0.5, cispo_eps_clip_high=0.3),
        sapo=c.SAPOConfig(tau_pos=1.0, tau_neg=1.05),
        dppo=c.DPPOConfig(dppo_type=dppo_type, delta_low=0.05, delta_high=0.08),
        clip_cov=c.ClipCovConfig(clip_ratio=0.2, clip_cov_lb=0.5, clip_cov_ub=5.0),
        kl_cov=c.KLCovConfig(kl_cov_frac=0.2, ppo_kl_coef=0.7),
        off_policy_correction=c.OffPolicyCorrectionConfig(**correction),
    )


def run(fn, b, cfg, advantages, rollout=True, mask="batch"):
    """(loss, d loss / d log_probs, metrics) of a SkyRL-convention loss; clip_cov's draw seeded."""
    log_probs = b.log_probs.clone().requires_grad_(True)
    torch.manual_seed(1234)
    loss, metrics = fn(
        log_probs,
        b.old_log_probs,
        advantages,
        cfg,
        b.mask if mask == "batch" else mask,
        b.rollout_logprobs if rollout else None,
    )
    loss.backward()
    return loss.detach(), log_probs.grad, metrics


def assert_same(ours, theirs, extra=()):
    torch.testing.assert_close(ours[0], theirs[0], **TOL)
    torch.testing.assert_close(ours[1], theirs[1], **TOL)
    assert_metrics_close(ours[2], theirs[2], extra)


def _extra(name):
    return CISPO_EXTRA if name == "cispo" else ()


@pytest.mark.parametrize("seed", (0, 1))
@pytest.mark.parametrize(
    "reduction",
    ("token_mean", "token_mean_legacy", "sequence_mean", "seq_mean_token_sum_norm", "prompt_mean"),
)
@pytest.mark.parametrize("name", LOSSES)
def test_final_loss_matches_skyrl_for_every_reduction(skyrl, name, reduction, seed):
    """Advantages scaled for the reduction (ours vs SkyRL's), then the loss: SkyRL's scalar and gradient."""
    b = make_batch(seed, SIZES)
    kwargs = dict(micro_batch_size=4, max_seq_len=24, prompt_boundaries=groups.prompt_boundaries(b.uids))
    ours_adv = scale_advantages(b.advantages, b.mask, reduction, **kwargs)
    sky_adv = skyrl.ppo.apply_loss_reduction_to_advantages_minibatch(
        b.advantages, b.mask, reduction, **kwargs
    )
    torch.testing.assert_close(ours_adv, sky_adv, **TOL)
    cfg = skyrl_config(skyrl, name)
    ours = run(get_policy_loss(name), b, cfg, ours_adv)
    sky = run(skyrl.ppo.PolicyLossRegistry.get(name), b, cfg, sky_adv)
    assert_same(ours, sky, _extra(name))


@pytest.mark.parametrize("correction", CORRECTIONS)
@pytest.mark.parametrize("name", WITH_CORRECTION)
def test_off_policy_correction_inside_the_loss_matches_skyrl(skyrl, name, correction):
    b = make_batch(3, SIZES, drift=0.3)
    cfg = skyrl_config(skyrl, name, **CORRECTIONS[correction])
    advantages = scale_advantages(b.advantages, b.mask, "token_mean")
    ours = run(get_policy_loss(name), b, cfg, advantages)
    sky = run(skyrl.ppo.PolicyLossRegistry.get(name), b, cfg, advantages)
    assert_same(ours, sky, _extra(name))
    assert any(k.startswith("is_ratio") for k in ours[2])


@pytest.mark.parametrize("seed", (0, 1, 2))
@pytest.mark.parametrize("name", ("clip_cov", "kl_cov"))
def test_cov_losses_match_skyrl_on_unscaled_advantages(skyrl, name, seed):
    """Scaled advantages make SkyRL's covariances tiny (clip_cov then clips nothing): check the selection
    itself on unscaled ones, clip_cov's random draw included."""
    b = make_batch(seed, SIZES)
    cfg = skyrl_config(skyrl, name)
    ours = run(get_policy_loss(name), b, cfg, b.advantages)
    assert_same(ours, run(skyrl.ppo.PolicyLossRegistry.get(name), b, cfg, b.advantages))
    if name == "clip_cov":
        assert float(ours[2]["clip_ratio"]) > 0


def _flat(section, prefix: str = "") -> dict:
    """A config section's leaf keys and values, `cispo.cispo_eps_clip_low` style."""
    out = {}
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        out |= (
            _flat(value, f"{prefix}{f.name}.")
            if dataclasses.is_dataclass(value)
            else {prefix + f.name: value}
        )
    return out


OUR_ALGORITHM_KEYS = {"cispo.cispo_anchor", "on_policy_distillation", "overlong_buffer_len",
                      "overlong_buffer_penalty_factor"}
"""`trainer.algorithm` keys SkyRL 0.3.0's AlgorithmConfig lacks (a later SkyRL's, an example's, ours)."""


def test_algorithm_defaults_are_skyrl_0_3_0s_key_by_key(skyrl):
    """Every key of SkyRL 0.3.0's own `AlgorithmConfig()` has its default in our `trainer.algorithm`."""
    ours, theirs = _flat(Config().trainer.algorithm), _flat(skyrl.config.AlgorithmConfig())
    assert set(ours) - set(theirs) == OUR_ALGORITHM_KEYS and set(theirs) <= set(ours)
    assert {key: ours[key] for key in theirs} == theirs


@pytest.mark.parametrize("name", LOSSES)
def test_our_default_config_gives_skyrls_default_loss(skyrl, name):
    """Each loss under our default `trainer.algorithm` equals SkyRL's function under SkyRL's own default
    config (not our parameters passed to it), so a wrong default fails here."""
    b = make_batch(7, SIZES, drift=0.6)
    advantages = scale_advantages(b.advantages, b.mask, "token_mean")
    ours_cfg = dataclasses.replace(Config().trainer.algorithm, policy_loss_type=name)
    ours = run(get_policy_loss(name), b, ours_cfg, advantages)
    sky = run(skyrl.ppo.PolicyLossRegistry.get(name), b, skyrl.config.AlgorithmConfig(policy_loss_type=name),
              advantages)
    assert_same(ours, sky, _extra(name))


def test_cispo_defaults_clip_the_weight_to_skyrls_band(skyrl):
    """SkyRL 0.3.0's CISPO band is [1, 6]: ratios below 1 are weighted 1, so the clamped mean exceeds the
    raw one on a batch whose ratios straddle 1 (the band [0, 5] would leave them)."""
    b = make_batch(7, SIZES, drift=0.6)
    _, _, metrics = run(get_policy_loss("cispo"), b, Config().trainer.algorithm, b.advantages)
    assert float(metrics["cispo/ratio_min"]) < 1 and float(metrics["clip_ratio"]) > 0
    assert float(metrics["cispo/ratio_clamped_mean"]) > float(metrics["cispo/ratio_mean"])


def test_correction_without_rollout_logprobs_is_skipped_as_in_skyrl(skyrl):
    b = make_batch(5, SIZES)
    cfg = skyrl_config(skyrl, "regular", **CORRECTIONS["token_tis"])
    ours = run(get_policy_loss("regular"), b, cfg, b.advantages, rollout=False)
    assert_same(ours, run(skyrl.ppo.PolicyLossRegistry.get("regular"), b, cfg, b.advantages, rollout=False))
    assert set(ours[2]) == {"clip_ratio"}


@pytest.mark.parametrize("name", ("rollout_is", "dppo"))
def test_losses_without_old_logprobs(skyrl, name):
    """rollout_is and dppo run without the old log-probs (SkyRL skips that forward for them), unless an
    off-policy correction needs them."""
    b = make_batch(6, SIZES)
    b.old_log_probs = None
    cfg = skyrl_config(skyrl, name)
    ours = run(get_policy_loss(name), b, cfg, b.advantages)
    assert_same(ours, run(skyrl.ppo.PolicyLossRegistry.get(name), b, cfg, b.advantages))
    with pytest.raises(ValueError, match="compute the old log-probs"):
        run(get_policy_loss(name), b, skyrl_config(skyrl, name, **CORRECTIONS["token_tis"]), b.advantages)


@pytest.mark.parametrize("name", WITHOUT_CORRECTION)
def test_losses_without_correction_refuse_one(skyrl, name):
    b = make_batch(0, SIZES)
    with pytest.raises(ValueError, match="does not apply trainer.algorithm.off_policy_correction"):
        run(get_policy_loss(name), b, skyrl_config(skyrl, name, **CORRECTIONS["token_tis"]), b.advantages)


@pytest.mark.parametrize("seed", (0, 1, 2))
@pytest.mark.parametrize("with_rollout", (True, False))
def test_dppo_binary_kl_matches_skyrl(skyrl, seed, with_rollout):
    b = make_batch(seed, SIZES, drift=0.5)
    cfg = skyrl_config(skyrl, "dppo", dppo_type="binary_kl")
    ours = run(get_policy_loss("dppo"), b, cfg, b.advantages, rollout=with_rollout)
    assert_same(
        ours, run(skyrl.ppo.PolicyLossRegistry.get("dppo"), b, cfg, b.advantages, rollout=with_rollout)
    )
    assert 0 < float(ours[2]["clip_ratio"]) < 1


@pytest.mark.parametrize("name", ("regular", "gspo", "cispo", "sapo", "importance_sampling"))
def test_no_loss_mask_means_every_token(skyrl, name):
    b = make_batch(2, SIZES)
    cfg = skyrl_config(skyrl, name)
    ours = run(get_policy_loss(name), b, cfg, b.advantages, mask=None)
    assert_same(
        ours, run(skyrl.ppo.PolicyLossRegistry.get(name), b, cfg, b.advantages, mask=None), _extra(name)
    )


def test_cispo_rollout_anchor_is_cispo_against_the_rollout_policy(skyrl):
    """SkyRL's later `cispo_anchor='rollout'`: 0.3.0's CISPO with the rollout log-probs as the old ones."""
    b = make_batch(4, SIZES)
    cfg = skyrl_config(skyrl, "cispo")
    anchored = skyrl_config(skyrl, "cispo")
    anchored.cispo.cispo_anchor = "rollout"
    ours = run(get_policy_loss("cispo"), b, anchored, b.advantages)
    b.old_log_probs = b.rollout_logprobs
    sky = run(skyrl.ppo.PolicyLossRegistry.get("cispo"), b, cfg, b.advantages)
    assert_same(ours, sky, CISPO_EXTRA)
    with pytest.raises(ValueError, match="needs the rollout log-probs"):
        run(get_policy_loss("cispo"), b, anchored, b.advantages, rollout=False)
    anchored.off_policy_correction.tis_ratio_type = "token"
    with pytest.raises(ValueError, match="count it twice"):
        run(get_policy_loss("cispo"), b, anchored, b.advantages)


def test_cispo_ratio_metrics():
    b = make_batch(6, SIZES)
    _, metrics = policy_losses.cispo_loss(
        b.log_probs, b.old_log_probs, b.advantages, b.mask, eps_clip_low=0.1, eps_clip_high=0.1
    )
    ratio = torch.exp(b.log_probs - b.old_log_probs)[b.mask.bool()]
    torch.testing.assert_close(metrics["cispo/ratio_mean"], ratio.mean(), **TOL)
    torch.testing.assert_close(metrics["cispo/ratio_clamped_mean"], ratio.clamp(0.9, 1.1).mean(), **TOL)
    torch.testing.assert_close(metrics["cispo/ratio_max"], ratio.max(), **TOL)
    torch.testing.assert_close(metrics["cispo/ratio_min"], ratio.min(), **TOL)


def test_bad_parameters_are_refused():
    b = make_batch(0, SIZES)
    with pytest.raises(ValueError, match="clip_ratio_c must be > 1"):
        policy_losses.ppo_clip_loss(b.log_probs, b.old_log_probs, b.advantages, b.mask, clip_ratio_c=1.0)
    with pytest.raises(ValueError, match="dppo_type"):
        policy_losses.dppo_loss(b.log_probs, b.old_log_probs, b.advantages, b.mask, dppo_type="topk_tv")


# ---- verl 0.9.1 -------------------------------------------------------------------------------------
def verl_actor(verl, low=0.2, high=0.28, clip_ratio_c=3.0, **policy_loss):
    c = verl.config
    return c.FSDPActorConfig(
        strategy="fsdp",
        rollout_n=1,
        ppo_micro_batch_size_per_gpu=1,
        clip_ratio=low,
        clip_ratio_low=low,
        clip_ratio_high=high,
        clip_ratio_c=clip_ratio_c,
        tau_pos=1.0,
        tau_neg=1.05,
        policy_loss=c.PolicyLossConfig(**policy_loss),
    )


def verl_run(fn, b, mask=None):
    log_probs = b.log_probs.clone().requires_grad_(True)
    torch.manual_seed(1234)
    out = fn(b.old_log_probs, log_probs, b.advantages, b.mask if mask is None else mask)
    out[0].backward()
    return out[0].detach(), log_probs.grad, out[1]


def ours_token_mean(skyrl, name, b, cfg=None):
    cfg = cfg or skyrl_config(skyrl, name)
    loss, grad, metrics = run(
        get_policy_loss(name), b, cfg, scale_advantages(b.advantages, b.mask, "token_mean")
    )
    return loss, grad, metrics


@pytest.mark.parametrize("seed", (0, 1))
@pytest.mark.parametrize("name", ("regular", "dual_clip"))
def test_ppo_matches_verl(skyrl, verl, name, seed):
    b = make_batch(seed, SIZES)
    actor = verl_actor(verl, clip_ratio_c=3.0 if name == "dual_clip" else 1e30)  # verl always dual-clips
    fn = verl.algos.get_policy_loss_fn("vanilla")
    ver = verl_run(lambda o, lp, a, m: fn(o, lp, a, m, loss_agg_mode="token-mean", config=actor), b)
    ours = ours_token_mean(skyrl, name, b)
    torch.testing.assert_close(ours[0], ver[0], **TOL)
    torch.testing.assert_close(ours[1], ver[1], **TOL)
    torch.testing.assert_close(float(ours[2]["clip_ratio"]), ver[2]["actor/pg_clipfrac"], **TOL)


@pytest.mark.parametrize("seed", (0, 1))
@pytest.mark.parametrize("name", ("gspo", "cispo", "sapo"))
def test_gspo_cispo_sapo_match_verl(skyrl, verl, name, seed):
    b = make_batch(seed, SIZES)
    b.mask[:, 0] = 1.0  # verl's sequence mean leaves empty rows out of the count, SkyRL's keeps them
    low, high = (0.5, 0.3) if name == "cispo" else (0.2, 0.28)
    actor = verl_actor(verl, low, high)
    fn = verl.algos.get_policy_loss_fn(name)
    ver = verl_run(lambda o, lp, a, m: fn(o, lp, a, m, loss_agg_mode="token-mean", config=actor), b)
    if name == "sapo":  # verl reduces SAPO by sequence mean whatever it is told
        cfg = skyrl_config(skyrl, name)
        ours = run(get_policy_loss(name), b, cfg, scale_advantages(b.advantages, b.mask, "sequence_mean"))
    else:
        ours = ours_token_mean(skyrl, name, b)
    torch.testing.assert_close(ours[0], ver[0], **TOL)
    torch.testing.assert_close(ours[1], ver[1], **TOL)
    if name != "sapo":
        torch.testing.assert_close(float(ours[2]["clip_ratio"]), ver[2]["actor/pg_clipfrac"], **TOL)


@pytest.mark.parametrize("seed", (0, 1))
def test_clip_cov_matches_verl(verl, seed):
    """On unscaled advantages, reduced by token mean as verl does (same random draw)."""
    b = make_batch(seed, SIZES)
    actor = verl_actor(verl, clip_cov_ratio=0.2, clip_cov_lb=0.5, clip_cov_ub=5.0)
    fn = verl.algos.get_policy_loss_fn("clip_cov")
    ver = verl_run(lambda o, lp, a, m: fn(o, lp, a, m, loss_agg_mode="token-mean", config=actor), b)
    ours = _pure_token_mean(
        lambda lp: cov_losses.clip_cov_loss(
            lp,
            b.old_log_probs,
            b.advantages,
            b.mask,
            eps_clip_low=0.2,
            eps_clip_high=0.28,
            clip_ratio=0.2,
            clip_cov_lb=0.5,
            clip_cov_ub=5.0,
        ),
        b,
    )
    torch.testing.assert_close(ours[0], ver[0], **TOL)
    torch.testing.assert_close(ours[1], ver[1], **TOL)
    torch.testing.assert_close(float(ours[2]["clip_ratio"]), ver[2]["actor/pg_clipfrac"], **TOL)
    assert float(ours[2]["clip_ratio"]) > 0


@pytest.mark.parametrize("seed", (0, 1))
def test_kl_cov_matches_verl(verl, seed):
    b = make_batch(seed, SIZES)
    actor = verl_actor(verl, kl_cov_ratio=0.2, ppo_kl_coef=0.7)
    fn = verl.algos.get_policy_loss_fn("kl_cov")
    ver = verl_run(lambda o, lp, a, m: fn(o, lp, a, m, loss_agg_mode="token-mean", config=actor), b)
    ours = _pure_token_mean(
        lambda lp: cov_losses.kl_cov_loss(
            lp, b.old_log_probs, b.advantages, b.mask, kl_cov_frac=0.2, ppo_kl_coef=0.7
        ),
        b,
    )
    torch.testing.assert_close(ours[0], ver[0], **TOL)
    torch.testing.assert_close(ours[1], ver[1], **TOL)


def _pure_token_mean(fn, b):
    log_probs = b.log_probs.clone().requires_grad_(True)
    torch.manual_seed(1234)
    loss, metrics = fn(log_probs)
    total = (loss * b.mask).sum() / b.mask.sum()
    total.backward()
    return total.detach(), log_probs.grad, metrics
