"""The shared training step on a real worker: micro-batching gives the exact token-mean gradient,
stale tokens switch on the off-policy correction (in the forward for one optimizer step, with a
separate proximal forward for several), zero-advantage groups are dropped."""

from __future__ import annotations

import pytest
import torch
from rl_support import rl_config, warm_model_dir

from inflight.rollout.generator import Trajectory, TrajectoryGroup
from inflight.tasks import Problem
from inflight.train import LocalPolicyWorker
from inflight.train.step import StepOptions, TrainingStep


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return warm_model_dir(tmp_path_factory)


def _groups(version: int, rewards: list[list[float]]) -> list[TrajectoryGroup]:
    gen = torch.Generator().manual_seed(0)
    groups = []
    for g, rs in enumerate(rewards):
        trajs = []
        for r in rs:
            n = int(torch.randint(1, 4, (1,), generator=gen))
            ids = torch.randint(2, 14, (n,), generator=gen).tolist() + [1]
            trajs.append(Trajectory([5, 12, 7, 13], ids, (-torch.rand(n + 1, generator=gen)).tolist(),
                                    [version] * (n + 1), [1] * (n + 1), r, "stop"))
        groups.append(TrajectoryGroup(Problem(f"p{g}", "3+5=", "8"), trajs))
    return groups


def _grads(model_dir, tmp_path, micro: int, groups, version: int, overrides=(), options=None):
    cfg, _ = rl_config(model_dir, tmp_path, [f"trainer.micro_train_batch_size_per_gpu={micro}", *overrides])
    worker = LocalPolicyWorker(cfg).setup()
    step = TrainingStep(worker, cfg, 0, options or StepOptions())
    captured = {}
    original = worker.optimizer_step

    def spy():
        captured.setdefault("grads", [p.grad.clone() for p in worker.model.parameters()])
        return original()

    worker.optimizer_step = spy
    metrics = step(groups, version)
    return captured.get("grads"), metrics


def test_micro_batches_give_the_exact_token_mean_gradient(model_dir, tmp_path):
    groups = _groups(0, [[1, 0, 0, 1], [0, 0, 1, 0], [1, 1, 1, 1]])
    whole, m1 = _grads(model_dir, tmp_path, 64, groups, 0)
    pieces, m2 = _grads(model_dir, tmp_path, 1, groups, 0)
    for a, b in zip(whole, pieces, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-4)
    assert m1["groups_dropped"] == 1 and m1["groups_trained"] == 2 and m1["optimizer_steps"] == 1
    assert m1["off_policy"] == 0 and "prox_forward_s" not in m1


def test_micro_batches_give_the_exact_dr_grpo_gradient(model_dir, tmp_path):
    """`seq_mean_token_sum_norm` divides by the mini-batch's longest response, not each
    micro-batch's: one row per micro-batch gives the gradient of the whole mini-batch at once."""
    groups = _groups(0, [[1, 0, 0, 1], [0, 0, 1, 0]])
    dr = ["trainer.algorithm.loss_reduction=seq_mean_token_sum_norm"]
    whole, _ = _grads(model_dir, tmp_path, 64, groups, 0, dr)
    pieces, _ = _grads(model_dir, tmp_path, 1, groups, 0, dr)
    for a, b in zip(whole, pieces, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-4)


def test_stale_tokens_turn_on_tis(model_dir, tmp_path):
    groups = _groups(0, [[1, 0, 0, 1], [0, 0, 1, 0]])
    _, single = _grads(model_dir, tmp_path, 64, groups, 2)
    assert single["off_policy"] == 1 and "prox_forward_s" not in single and "is_weight_mean" in single
    _, two = _grads(model_dir, tmp_path, 64, groups, 2, ["trainer.update_epochs_per_batch=2"])
    assert two["off_policy"] == 1 and "prox_forward_s" in two and two["optimizer_steps"] == 2
    _, off = _grads(model_dir, tmp_path, 64, groups, 2, options=StepOptions(tis="none"))
    assert off["off_policy"] == 1 and "is_weight_mean" not in off
