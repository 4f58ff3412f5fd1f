"""The training step computes SkyRL's objective: for estimators, losses, reductions, corrections and
the KL / entropy terms, the gradient of the step's first optimizer step equals the gradient computed
directly, in one pass, from transformers' logits and `inflight.algorithms`' functions (themselves
checked against SkyRL's and verl's in tests/algorithms), with one micro-batch and with one row per
micro-batch; and a mini-batch of a several-mini-batch step, whose old log-probabilities need their
own forward, gives the gradient of that mini-batch alone."""

from __future__ import annotations

import pytest
import torch
from objective_support import direct_grads, make_groups, step_grads

from inflight.testing import make_tiny_model

ALG = "trainer.algorithm."
CASES = {
    "grpo-regular-token_mean": ([], 0),
    "rloo-dual_clip-sequence_mean-token_tis": ([
        ALG + "advantage_estimator=rloo", ALG + "policy_loss_type=dual_clip",
        ALG + "loss_reduction=sequence_mean", ALG + "eps_clip_high=0.28",
        ALG + "off_policy_correction.tis_ratio_type=token",
        ALG + "off_policy_correction.token_tis_ratio_clip_high=1.1"], 2),
    "maxrl-gspo-seq_mean_token_sum_norm-masks": ([
        ALG + "advantage_estimator=maxrl", ALG + "policy_loss_type=gspo",
        ALG + "loss_reduction=seq_mean_token_sum_norm", ALG + "max_seq_len=40",
        ALG + "off_policy_correction.tis_ratio_type=sequence",
        ALG + "off_policy_correction.sequence_tis_ratio_clip_high=1.2",
        ALG + "off_policy_correction.sequence_mask_metric=geometric",
        ALG + "off_policy_correction.geo_mask_low=0.9", ALG + "off_policy_correction.geo_mask_high=1.1",
        ALG + "off_policy_correction.token_mask_is_threshold_low=0.5",
        ALG + "off_policy_correction.token_mask_is_threshold_high=1.5"], 1),
    "reinforce++-cispo-prompt_mean-normalized": ([
        ALG + "advantage_estimator=reinforce++", ALG + "gamma=0.9", ALG + "policy_loss_type=cispo",
        ALG + "loss_reduction=prompt_mean", ALG + "advantage_batch_normalize=true"], 0),
    "grpo-sapo-sequence_mean-no_std": ([
        ALG + "policy_loss_type=sapo", ALG + "loss_reduction=sequence_mean", ALG + "grpo_norm_by_std=false",
        ALG + "sapo.tau_neg=1.3"], 0),
    "rloo-rollout_is": ([ALG + "advantage_estimator=rloo", ALG + "policy_loss_type=rollout_is",
                         ALG + "eps_clip_low=0.3"], 1),
    "grpo-dppo-binary_kl": ([ALG + "policy_loss_type=dppo", ALG + "dppo.dppo_type=binary_kl",
                             ALG + "dppo.delta_high=0.05"], 0),
    "grpo-importance_sampling-kl_cov-free": ([ALG + "policy_loss_type=importance_sampling"], 0),
}  # fmt: skip


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("objective")
    return make_tiny_model(root / "policy", seed=0), make_tiny_model(root / "teacher", seed=1)


@pytest.fixture(scope="module")
def groups(models):
    return {version: make_groups(models[0], version) for version in (0, 1, 2)}


def _close(got, want):
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=2e-6, rtol=1e-4)


@pytest.mark.parametrize("name", list(CASES))
def test_the_step_gradient_is_the_objective_s(models, groups, tmp_path, name):
    overrides, version = CASES[name]
    want = direct_grads(models[0], tmp_path, overrides, groups[version])
    for micro in (64, 1):
        got, metrics = step_grads(
            models[0], tmp_path, [*overrides, f"trainer.micro_train_batch_size_per_gpu={micro}"],
            groups[version], version,
        )
        _close(got, want)
        assert metrics["groups_dropped"] == 1 and metrics["optimizer_steps"] == 1
        assert "prox_forward_s" not in metrics  # one optimizer step: the training forward is the old policy
    assert max(float(g.abs().max()) for g in want) > 1e-5


def test_token_mean_legacy_averages_skyrl_s_micro_batches(models, groups, tmp_path):
    """token_mean_legacy means per micro-batch of `micro_train_batch_size_per_gpu` consecutive rows
    (SkyRL's), whatever micro-batches the step runs: the scaling decides, not the cut."""
    overrides = [ALG + "loss_reduction=token_mean_legacy", "trainer.micro_train_batch_size_per_gpu=2"]
    want = direct_grads(models[0], tmp_path, overrides, groups[0])
    got, _ = step_grads(models[0], tmp_path, overrides, groups[0], 0)
    _close(got, want)
    plain, _ = step_grads(models[0], tmp_path, ["trainer.micro_train_batch_size_per_gpu=2"], groups[0], 0)
    assert max(float((a - b).abs().max()) for a, b in zip(got, plain, strict=True)) > 1e-6


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3", "abs"])
def test_kl_loss_and_entropy_bonus(models, groups, tmp_path, estimator):
    """The KL loss to a reference (another model) with each estimator, and the entropy bonus, whose
    gradient and logged value are autograd's and the value of SkyRL's entropy of transformers' logits:
    per micro-batch of `micro_train_batch_size_per_gpu` consecutive rows, a token mean, weighted by
    rows (one micro-batch: the mini-batch's token mean; one row each, SkyRL's default: the mean of the
    rows' means), whatever micro-batches the step runs."""
    overrides = [
        ALG + "use_kl_loss=true", ALG + "kl_loss_coef=0.3", ALG + f"kl_estimator_type={estimator}",
        ALG + "use_entropy_loss=true", ALG + "entropy_loss_coef=0.05", "trainer.logprobs_chunk_size=5",
    ]
    entropies = []
    for micro in (64, 1):
        cut = [*overrides, f"trainer.micro_train_batch_size_per_gpu={micro}"]
        record = {}
        want = direct_grads(models[0], tmp_path, cut, groups[0], ref_dir=models[1], record=record)
        got, metrics = step_grads(models[0], tmp_path, cut, groups[0], 0, ref_dir=models[1])
        _close(got, want)
        torch.testing.assert_close(metrics["policy_entropy"], record["policy_entropy"], atol=0, rtol=1e-5)
        entropies.append(record["policy_entropy"])
        assert metrics["kl"] > 0
    assert abs(entropies[0] - entropies[1]) > 1e-3 * entropies[0]  # SkyRL's cut matters: the test sees it


def test_a_mini_batch_of_several_gets_its_own_old_forward(models, groups, tmp_path):
    """Three mini-batches of one prompt (the synchronous trainer): the first optimizer step's gradient
    is the first mini-batch's alone, its old log-probabilities a forward of their own (in the
    training micro-batches, or in forward micro-batches)."""
    overrides = ["trainer.fully_async.enabled=false", "trainer.policy_mini_batch_size=1",
                 ALG + "policy_loss_type=dual_clip", ALG + "loss_reduction=sequence_mean"]
    want = direct_grads(models[0], tmp_path, overrides, groups[1], rows=slice(0, 4))
    for extra in (
        [],
        ["trainer.recompute_old_logprobs_per_minibatch=false", "trainer.micro_forward_batch_size_per_gpu=3"],
    ):
        got, metrics = step_grads(models[0], tmp_path, [*overrides, *extra], groups[1], 1)
        _close(got, want)
        assert "prox_forward_s" in metrics and metrics["optimizer_steps"] == 3  # one per mini-batch, as SkyRL
