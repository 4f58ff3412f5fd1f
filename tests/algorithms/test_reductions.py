"""inflight.algorithms.reductions and groups against SkyRL 0.3.0's loss reductions, its trainer's
per-mini-batch normalization, prompt boundaries and zero-variance filter."""

from __future__ import annotations

import pytest
import torch
from algorithm_batches import SEEDS, TOL, fake_trainer, group_uids, random_mask

from inflight.algorithms import groups, reductions

SIZES = (2, 3, 1, 4, 2)  # 12 rows, prompts of 1 to 4 samples
REDUCTIONS = reductions.LOSS_REDUCTIONS


def _batch(seed: int) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    gen = torch.Generator().manual_seed(seed)
    mask = random_mask(gen, sum(SIZES), 9)
    mask[5] = 0  # an all-masked prompt (the one-sample group p2)
    return torch.randn(sum(SIZES), 9, generator=gen), mask, group_uids(SIZES)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_scale_advantages_matches_skyrl(skyrl, seed, reduction):
    advantages, mask, uids = _batch(seed)
    bounds = groups.prompt_boundaries(uids)
    kwargs = dict(micro_batch_size=3, max_seq_len=20, prompt_boundaries=bounds)
    ours = reductions.scale_advantages(advantages, mask, reduction, **kwargs)
    sky = skyrl.ppo.apply_loss_reduction_to_advantages_minibatch(advantages, mask, reduction, **kwargs)
    torch.testing.assert_close(ours, sky, **TOL)


@pytest.mark.parametrize("reduction", ["token_mean", "sequence_mean", "prompt_mean"])
def test_an_all_masked_minibatch_divides_by_one(skyrl, reduction):
    advantages, mask = torch.randn(4, 5), torch.zeros(4, 5)
    bounds = [(0, 2), (2, 4)]
    ours = reductions.scale_advantages(advantages, mask, reduction, prompt_boundaries=bounds)
    sky = skyrl.ppo.apply_loss_reduction_to_advantages_minibatch(advantages, mask, reduction, 2, 1, bounds)
    torch.testing.assert_close(ours, sky, **TOL)
    assert torch.isfinite(ours).all()


def test_seq_mean_token_sum_norm_needs_max_seq_len():
    with pytest.raises(ValueError, match="trainer.algorithm.max_seq_len"):
        reductions.scale_advantages(torch.ones(2, 3), torch.ones(2, 3), "seq_mean_token_sum_norm")


def test_token_mean_legacy_refuses_a_partial_micro_batch(skyrl):
    """SkyRL silently gives the rows past the last whole micro-batch advantage 0; we refuse."""
    advantages, mask = torch.randn(5, 4), torch.ones(5, 4)
    sky = skyrl.ppo.apply_loss_reduction_to_advantages_minibatch(advantages, mask, "token_mean_legacy", 2, 4)
    assert torch.all(sky[4] == 0) and torch.all(sky[:4] != 0)
    with pytest.raises(ValueError, match="whole micro-batches"):
        reductions.scale_advantages(advantages, mask, "token_mean_legacy", micro_batch_size=2)


def test_unknown_reduction_names_the_choices():
    with pytest.raises(ValueError, match="token_mean, token_mean_legacy"):
        reductions.scale_advantages(torch.ones(1, 1), torch.ones(1, 1), "mean")


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_minibatch_scaling_matches_skyrls_trainer(skyrl, skyrl_trainer, seed, reduction):
    """SkyRL's trainer `_normalize_advantages`: each mini-batch scaled alone, prompt boundaries rebased."""
    advantages, mask, uids = _batch(seed)
    minibatches = [(0, 5), (5, 6), (6, 12)]  # whole prompts: 2+3, 1, 4+2
    bounds = groups.prompt_boundaries(uids)
    cfg = skyrl.config.AlgorithmConfig(loss_reduction=reduction, max_seq_len=20)
    legacy = reduction == "token_mean_legacy"
    data = skyrl_trainer.batch.TrainingInputBatch(
        {"advantages": advantages.clone(), "response_mask": mask, "loss_mask": mask}
    )
    sky = skyrl_trainer.trainer.RayPPOTrainer._normalize_advantages(
        fake_trainer(cfg, micro_batch_size=1 if legacy else 3), data, minibatches, bounds
    )["advantages"]
    ours = reductions.scale_minibatch_advantages(
        advantages,
        mask,
        reduction,
        minibatches,
        micro_batch_size=1 if legacy else 3,
        max_seq_len=20,
        prompt_boundaries=bounds,
    )
    torch.testing.assert_close(ours, sky, **TOL)


@pytest.mark.parametrize("uids", [group_uids(SIZES), ["a"], [], [3, 3, 1, 2, 2, 2]])
def test_prompt_boundaries_match_skyrl(skyrl_trainer, uids):
    assert groups.prompt_boundaries(uids) == skyrl_trainer.preprocess.compute_prompt_boundaries(uids)


def test_prompt_boundaries_refuse_interleaved_prompts():
    with pytest.raises(ValueError, match="contiguous"):
        groups.prompt_boundaries(["a", "b", "a"])


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("tol", [0.0, 1e-6, 0.3])
def test_zero_variance_filter_matches_skyrl(skyrl_trainer, seed, tol):
    gen = torch.Generator().manual_seed(seed)
    uids = group_uids((3, 1, 4, 2, 3))
    rewards = torch.randint(0, 2, (len(uids),), generator=gen).float().tolist()
    rewards[0:3] = [1.0, 1.0, 1.0 + 1e-7]  # zero variance within 1e-6
    rewards[6] = 0.25  # a spread below 0.3
    masks = [[1, 1] if torch.rand(1, generator=gen) > 0.2 else [0, 0] for _ in uids]
    for loss_masks in (None, masks):
        ours = groups.zero_variance_filter(rewards, uids, loss_masks, tol)
        assert ours == skyrl_trainer.trainer_utils.zero_variance_filter(rewards, uids, loss_masks, tol)
    assert groups.zero_variance_filter(
        torch.tensor(rewards), uids, torch.tensor(masks), tol
    ) == groups.zero_variance_filter(rewards, uids, masks, tol)
