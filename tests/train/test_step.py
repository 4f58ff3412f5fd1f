"""The shared training step on a real worker: where the old log-probabilities come from (the training
forward for one optimizer step; a forward of their own for several, or when the rewards need them
first), the off-policy correction against the rollout's, stale tokens reported, the zero-variance
filter, a batch with nothing to learn from."""

from __future__ import annotations

import pytest
from objective_support import BASE, make_groups, step_grads
from rl_support import rl_config

from inflight.testing import make_tiny_model
from inflight.train import LocalPolicyWorker
from inflight.train.step import TrainingStep

OPC = "trainer.algorithm.off_policy_correction."


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("step") / "m", seed=0)


@pytest.fixture(scope="module")
def groups(model_dir):
    return make_groups(model_dir, 1, noise=0.05)


def test_one_optimizer_step_needs_no_old_forward(model_dir, groups, tmp_path):
    _, metrics = step_grads(model_dir, tmp_path, [OPC + "tis_ratio_type=token"], groups, 2)
    assert metrics["off_policy"] == 1 and "prox_forward_s" not in metrics
    assert metrics["is_ratio_mean"] == pytest.approx(1.0, abs=0.05) and "tis_token_clip_high_ratio" in metrics
    _, on = step_grads(model_dir, tmp_path, [], groups, 1)
    assert on["off_policy"] == 0 and "tis_token_clip_high_ratio" not in on


@pytest.mark.parametrize("overrides", [
    ["trainer.update_epochs_per_batch=2"],
    ["trainer.algorithm.use_kl_in_reward=true", "trainer.algorithm.use_kl_loss=false"],
])  # fmt: skip
def test_several_optimizer_steps_or_rewards_from_them_need_an_old_forward(
    model_dir, groups, tmp_path, overrides
):
    _, metrics = step_grads(
        model_dir, tmp_path, overrides, groups, 1, ref_dir=model_dir if "kl" in overrides[0] else None
    )
    assert "prox_forward_s" in metrics


def test_losses_that_read_the_rollout_need_no_old_forward(model_dir, groups, tmp_path):
    _, metrics = step_grads(model_dir, tmp_path, ["trainer.update_epochs_per_batch=2",
                                                  "trainer.algorithm.policy_loss_type=rollout_is"], groups, 1)
    assert "prox_forward_s" not in metrics and metrics["optimizer_steps"] == 2


def test_zero_variance_groups_train_nothing_and_a_batch_without_signal_takes_no_step(
    model_dir, groups, tmp_path
):
    _, metrics = step_grads(model_dir, tmp_path, [], groups, 1)
    assert metrics["groups_dropped"] == 1 and metrics["groups_trained"] == 2
    assert metrics["trained_tokens"] == sum(sum(t.loss_mask) for g in groups[:2] for t in g.trajectories)
    flat = make_groups(model_dir, 1, rewards=[[1.0] * 4, [0.0] * 4, [0.5] * 4])
    grads, metrics = step_grads(model_dir, tmp_path, [], flat, 1)
    assert grads is None and metrics["optimizer_steps"] == 0 and metrics["is_ratio_mean"] is None
    grads, metrics = step_grads(
        model_dir, tmp_path, ["trainer.algorithm.zero_variance_filter=false"], flat, 1
    )
    assert grads is not None and metrics["groups_trained"] == 3  # GRPO gives them advantage 0, SkyRL's way


def test_groups_of_unequal_size_are_refused(model_dir, groups, tmp_path):
    cfg, _ = rl_config(model_dir, tmp_path, list(BASE))
    step = TrainingStep(LocalPolicyWorker(cfg).setup(), cfg, 0)
    short = [groups[0], type(groups[1])(groups[1].problem, groups[1].trajectories[:2])]
    with pytest.raises(ValueError, match="same number of trajectories"):
        step(short, 1)


def test_a_run_without_its_reference_or_critic_is_refused(model_dir, tmp_path):
    for overrides, what in (
        (["trainer.algorithm.use_kl_loss=true"], "reference"),
        ([f"trainer.critic.model.path={model_dir}", "trainer.algorithm.advantage_estimator=gae"], "critic"),
    ):
        cfg, _ = rl_config(model_dir, tmp_path, [*BASE, *overrides])
        with pytest.raises(ValueError, match=what):
            TrainingStep(LocalPolicyWorker(cfg), cfg, 0)
