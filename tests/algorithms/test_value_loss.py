"""inflight.algorithms.value against SkyRL 0.3.0's ppo_critic_loss and verl 0.9.1's compute_value_loss."""

from __future__ import annotations

import pytest
import torch
from algorithm_batches import SEEDS, TOL, make_batch

from inflight.algorithms import value_loss


def _inputs(seed: int):
    b = make_batch(seed)
    gen = torch.Generator().manual_seed(100 + seed)
    old = b.values
    values = old + 0.4 * torch.randn(old.shape, generator=gen)
    returns = old + torch.randn(old.shape, generator=gen)
    return values, old, returns, b.mask


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("clip", [0.2, None])
def test_value_loss_matches_skyrl(skyrl, seed, clip):
    values, old, returns, mask = _inputs(seed)
    cfg = skyrl.config.AlgorithmConfig(value_clip=clip)
    for loss_mask in (mask, None):
        ours_v = values.clone().requires_grad_(True)
        sky_v = values.clone().requires_grad_(True)
        ours, ours_frac = value_loss(ours_v, old, returns, loss_mask, clip)
        sky, sky_frac = skyrl.ppo.ppo_critic_loss(sky_v, old, returns, cfg, loss_mask)
        ours.backward()
        sky.backward()
        torch.testing.assert_close(ours, sky, **TOL)
        torch.testing.assert_close(ours_v.grad, sky_v.grad, **TOL)
        if clip is None:
            assert ours_frac is None and sky_frac is None
        else:
            assert 0 < float(ours_frac) < 1
            torch.testing.assert_close(float(ours_frac), sky_frac, **TOL)


@pytest.mark.parametrize("seed", SEEDS)
def test_value_loss_matches_verls_sequence_mean(verl, seed):
    """verl's seq-mean-token-mean leaves all-masked rows out of the mean: compare on rows that all count."""
    values, old, returns, mask = _inputs(seed)
    mask[:, 0] = 1.0
    ours, ours_frac = value_loss(values, old, returns, mask, 0.2)
    ver, ver_frac = verl.algos.compute_value_loss(values, returns, old, mask, 0.2, "seq-mean-token-mean")
    torch.testing.assert_close(ours, ver, **TOL)
    torch.testing.assert_close(ours_frac, ver_frac, **TOL)
