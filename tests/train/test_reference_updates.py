"""The reference model beyond a frozen base: `update_ref_every_epoch` (the policy's weights go into
the reference once an epoch is trained), on-policy distillation (the reference is the teacher and the
student moves toward it), and a checkpoint that keeps the critic, the updated reference and the KL
controller for the resumed run."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch
from objective_support import BASE, make_groups
from rl_support import rl_config

from inflight.testing import make_tiny_model
from inflight.train import LocalPolicyWorker
from inflight.train.checkpoint import load_latest
from inflight.train.policy import LocalPolicy
from inflight.train.step import TrainingStep, build_batch

ALG = "trainer.algorithm."


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("reference")
    return make_tiny_model(root / "student", seed=0), make_tiny_model(root / "teacher", seed=1)


def _epoch(groups, epoch: int):
    return [dataclasses.replace(g, epoch=epoch) for g in groups]


def _state(worker) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in worker.full_hf_state_dict().items()}


def test_the_reference_takes_the_policy_once_an_epoch_is_trained(models, tmp_path):
    groups = make_groups(models[0], 0)
    cfg, _ = rl_config(models[0], tmp_path, [*BASE, ALG + "use_kl_loss=true", ALG + "kl_loss_coef=0.1",
                                             "trainer.update_ref_every_epoch=true", "trainer.epochs=3"])
    worker = LocalPolicyWorker(cfg).setup()
    reference = LocalPolicyWorker(cfg, role="ref")
    reference.build_model()
    step = TrainingStep(worker, cfg, 0, reference=reference)
    base = _state(reference)
    assert "ref_updated" not in step(_epoch(groups, 0), 0)
    after_epoch_0 = _state(worker)
    assert all(torch.equal(base[k], v) for k, v in _state(reference).items())  # epoch 0 still runs
    mixed = _epoch(groups, 1)
    mixed[0] = dataclasses.replace(mixed[0], epoch=0)  # a straggler of epoch 0: not yet
    assert "ref_updated" not in step(mixed, 1)
    after_mixed = _state(worker)
    metrics = step(_epoch(groups, 1), 2)
    assert metrics["ref_updated"] == 1 and step.ref_epoch == 1
    ref_now = _state(reference)
    assert all(torch.equal(ref_now[k], v) for k, v in after_mixed.items())
    assert any(not torch.equal(after_epoch_0[k], v) for k, v in after_mixed.items())
    with pytest.raises(Exception, match="update_ref_every_epoch"):
        # no reference to update
        rl_config(models[0], tmp_path, [*BASE, "trainer.update_ref_every_epoch=true"])


def test_on_policy_distillation_moves_the_student_toward_the_teacher(models, tmp_path):
    """SkyRL's on-policy distillation: per-token rewards -(log pi_student - log pi_teacher), `no_op`
    advantages, the importance-sampling loss; the student's log-probabilities of the sampled tokens
    move toward the teacher's."""
    cfg, _ = rl_config(models[0], tmp_path, [
        *BASE, ALG + "on_policy_distillation=true", ALG + "advantage_estimator=no_op",
        ALG + "policy_loss_type=importance_sampling", ALG + "use_kl_loss=false",
        f"trainer.ref.model.path={models[1]}",
        ALG + "zero_variance_filter=false", "trainer.policy.optimizer_config.lr=3e-3"])  # fmt: skip
    worker = LocalPolicyWorker(cfg).setup()
    teacher = LocalPolicyWorker(cfg, model_path=str(models[1]), role="ref")
    teacher.build_model()
    step = TrainingStep(worker, cfg, 0, reference=teacher)
    groups = make_groups(models[0], 0, observation=False)
    batch = build_batch(groups, None, 0)
    mask = batch.loss_mask > 0

    def gap() -> float:
        return float((worker.logprobs(batch) - teacher.logprobs(batch))[mask].abs().mean())

    gaps = [gap()]
    for _ in range(5):
        metrics = step(groups, 0)
        gaps.append(gap())
    assert gaps[-1] < 0.7 * gaps[0] and "distill/reverse_kl" in metrics
    with pytest.raises(Exception, match="use_kl_in_reward"):
        rl_config(
            models[0],
            tmp_path,
            [
                *BASE, ALG + "on_policy_distillation=true", ALG + "use_kl_in_reward=true",
                ALG + "use_kl_loss=false",
            ],
        )


class _NoEngine:
    """A stand-in for rank 0's client: this test saves and loads, it never syncs."""


def test_a_checkpoint_keeps_the_critic_the_updated_reference_and_the_kl_controller(models, tmp_path):
    cfg, job = rl_config(models[0], tmp_path, [
        *BASE, ALG + "advantage_estimator=gae", f"trainer.critic.model.path={models[0]}",
        ALG + "use_kl_loss=false", ALG + "use_kl_in_reward=true", ALG + "kl_ctrl.type=adaptive",
        ALG + "kl_ctrl.horizon=10", "trainer.update_ref_every_epoch=true", "trainer.epochs=3",
        f"trainer.ckpt_path={tmp_path / 'ckpt'}",
        "trainer.policy.optimizer_config.lr=1e-3"])  # fmt: skip
    groups = make_groups(models[0], 0)
    policy = LocalPolicy.load(cfg, job, 0, models[0], _NoEngine(), None, 0)
    policy.step_fn(_epoch(groups, 0), 0)
    policy.step_fn(_epoch(groups, 1), 1)
    assert policy.step_fn.ref_epoch == 1 and policy.step_fn.objective.kl_controller.value != 0.001
    asyncio.run(policy.save(cfg.trainer.ckpt_path, 2, {"consumed": {}}, {}, -1))
    ckpt = load_latest(cfg.trainer.ckpt_path)
    assert (ckpt.path / "critic").is_dir() and (ckpt.path / "ref").is_dir()
    resumed = LocalPolicy.load(cfg, job, 0, ckpt.model_dir, _NoEngine(), None, ckpt.weight_version, ckpt=ckpt)
    assert resumed.step_fn.ref_epoch == 1
    assert resumed.step_fn.objective.kl_controller.value == pytest.approx(
        policy.step_fn.objective.kl_controller.value
    )
    for old, new in ((policy.critic, resumed.critic), (policy.reference, resumed.reference)):
        saved, loaded = _state(old), _state(new)
        assert all(torch.equal(saved[k], loaded[k]) for k in saved)
    moments = lambda w: [s["exp_avg"] for s in w.optimizer.state_dict()["state"].values()]  # noqa: E731
    assert all(
        torch.equal(a, b) for a, b in zip(moments(policy.critic), moments(resumed.critic), strict=True)
    )
