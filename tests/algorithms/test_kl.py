"""inflight.algorithms.kl against SkyRL 0.3.0 (compute_approx_kl, the worker's KL loss, the trainer's
KL-in-reward, its controllers) and verl 0.9.1 (kl_penalty, controllers)."""

from __future__ import annotations

import math

import pytest
import torch
from algorithm_batches import SEEDS, TOL, as_float, fake_trainer, make_batch

from inflight.algorithms import kl

ESTIMATORS = ("k1", "abs", "k2", "k3")
VERL_NAMES = {"k1": "kl", "abs": "abs", "k2": "mse", "k3": "low_var_kl"}


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_approx_kl_matches_skyrl(skyrl, estimator, seed):
    b = make_batch(seed, drift=2.0)  # wide enough for k3's clamps to bind
    ref = b.rollout_logprobs - 25.0 * (torch.arange(b.mask.shape[1]) == 3)  # a log-ratio past the +-20 clamp
    for mask in (None, b.mask):
        ours = kl.approx_kl(b.log_probs, ref, mask, estimator)
        torch.testing.assert_close(
            ours, skyrl.ppo.compute_approx_kl(b.log_probs, ref, mask, estimator), **TOL
        )


def test_masked_positions_are_zero_even_when_nan(skyrl):
    b = make_batch(0)
    ref = b.rollout_logprobs.masked_fill(b.mask == 0, float("nan"))
    ours = kl.approx_kl(b.log_probs, ref, b.mask, "k3")
    assert torch.all(ours[b.mask == 0] == 0) and torch.isfinite(ours).all()
    torch.testing.assert_close(ours, skyrl.ppo.compute_approx_kl(b.log_probs, ref, b.mask, "k3"), **TOL)


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_approx_kl_matches_verl_under_its_names(verl, estimator):
    b = make_batch(1, drift=2.0)
    theirs = verl.algos.kl_penalty(b.log_probs, b.rollout_logprobs, VERL_NAMES[estimator])
    for name in (estimator, VERL_NAMES[estimator]):
        torch.testing.assert_close(kl.approx_kl(b.log_probs, b.rollout_logprobs, None, name), theirs, **TOL)


def test_unknown_estimator_names_the_choices():
    with pytest.raises(ValueError, match="k1, abs, k2, k3"):
        kl.approx_kl(torch.zeros(1, 1), torch.zeros(1, 1), None, "k4")


@pytest.mark.parametrize("seed", SEEDS)
def test_kl_loss_is_the_workers(skyrl, seed):
    """SkyRL's worker: masked_mean(compute_approx_kl(...), loss_mask, dim=-1).mean(); gradients too."""
    b = make_batch(seed)
    ours_lp = b.log_probs.clone().requires_grad_(True)
    sky_lp = b.log_probs.clone().requires_grad_(True)
    ours = kl.kl_loss(ours_lp, b.rollout_logprobs, b.mask, "k3")
    sky_kl = skyrl.ppo.compute_approx_kl(sky_lp, b.rollout_logprobs, b.mask, "k3")
    sky = skyrl.torch_utils.masked_mean(sky_kl, b.mask, dim=-1).mean()
    ours.backward()
    sky.backward()
    torch.testing.assert_close(ours, sky, **TOL)
    torch.testing.assert_close(ours_lp.grad, sky_lp.grad, **TOL)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("coef", [0.05, -0.1])
def test_kl_in_reward_matches_skyrls_trainer(skyrl, skyrl_trainer, seed, coef):
    """SkyRL's `apply_reward_kl_penalty` (a negative coefficient counts as 0 there)."""
    b = make_batch(seed)
    cfg = skyrl.config.AlgorithmConfig(
        use_kl_in_reward=True, use_kl_loss=False, kl_loss_coef=coef, kl_estimator_type="k2"
    )
    data = skyrl_trainer.batch.TrainingInputBatch(
        {
            "loss_mask": b.mask,
            "rewards": b.rewards.clone(),
            "base_action_log_probs": b.rollout_logprobs,
            "action_log_probs": b.log_probs,
        }
    )
    data.metadata = {}
    fake = fake_trainer(cfg, micro_batch_size=1)
    sky = skyrl_trainer.trainer.RayPPOTrainer.apply_reward_kl_penalty(fake, data)
    rewards, metrics = kl.kl_penalized_rewards(b.rewards, b.log_probs, b.rollout_logprobs, b.mask, coef, "k2")
    torch.testing.assert_close(rewards, sky["rewards"], **TOL)
    for key in ("avg_kl", "avg_kl_max", "kl_loss_coef"):
        assert math.isclose(as_float(metrics[key]), sky.metadata["metrics"][key], rel_tol=1e-6, abs_tol=1e-6)


@pytest.mark.parametrize("kind", ["fixed", "adaptive"])
def test_controllers_match_skyrl_and_verl(skyrl, verl, kind):
    cfg = skyrl.config.AlgorithmConfig(
        kl_loss_coef=0.02, kl_ctrl=skyrl.config.KLCtrlConfig(type=kind, kl_target=0.05, horizon=500)
    )
    ours = kl.make_kl_controller(kind, 0.02, 0.05, 500)
    sky = skyrl.ppo.get_kl_controller(cfg)
    ver = (
        verl.algos.FixedKLController(0.02)
        if kind == "fixed"
        else verl.algos.AdaptiveKLController(0.02, 0.05, 500)
    )
    for current, n in [(0.01, 64), (0.2, 64), (0.051, 32), (1.0, 128), (0.0, 8)]:
        for ctrl in (ours, sky, ver):
            ctrl.update(current, n)
        assert ours.value == float(sky.value) == float(ver.value)
    assert (ours.value == 0.02) == (kind == "fixed")


def test_adaptive_controller_needs_a_horizon(skyrl):
    with pytest.raises(ValueError, match="horizon must be > 0"):
        kl.make_kl_controller("adaptive", 0.1, 0.1, 0)
    with pytest.raises(ValueError, match="'fixed' or 'adaptive'"):
        kl.make_kl_controller("pid", 0.1)
