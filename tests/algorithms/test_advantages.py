"""inflight.algorithms.advantages against SkyRL 0.3.0's estimators (and verl 0.9.1's where it has a twin
that computes the same thing)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from algorithm_batches import SEEDS, TOL, fake_trainer, make_batch, random_mask

from inflight.algorithms import advantages as adv
from inflight.algorithms import compute_advantages_and_returns


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("norm_by_std", [True, False])
def test_grpo_matches_skyrl_and_verl(skyrl, verl, seed, norm_by_std):
    b = make_batch(seed)
    ours = adv.grpo_advantages(b.rewards, b.mask, b.uids, norm_by_std=norm_by_std)
    sky = skyrl.ppo.compute_grpo_outcome_advantage(
        b.rewards.clone(), b.mask, np.array(b.uids), grpo_norm_by_std=norm_by_std
    )
    ver = verl.algos.compute_grpo_outcome_advantage(
        b.rewards.clone(), b.mask, np.array(b.uids), norm_adv_by_std_in_grpo=norm_by_std
    )
    for theirs in (sky, ver):
        torch.testing.assert_close(ours[0], theirs[0], **TOL)
        torch.testing.assert_close(ours[1], theirs[1], **TOL)


def test_grpo_edge_cases_are_skyrls(skyrl):
    """One-sample groups keep s / (1 + eps) (not 0), all-equal groups get exactly 0, empty rows 0."""
    b = make_batch(0)
    ours, _ = adv.grpo_advantages(b.rewards, b.mask, b.uids)
    assert b.mask[0].sum() == 0 and torch.all(ours[0] == 0)
    one, _ = adv.grpo_advantages(torch.tensor([[0.0, 0, 0, 0.6]]), torch.ones(1, 4), ["solo"])
    torch.testing.assert_close(one, torch.full((1, 4), 0.6) / (1 + 1e-6))
    equal = slice(1, 4)  # group p1 (3 rows), all 0.7
    assert torch.all(ours[equal] == 0)
    torch.testing.assert_close(
        ours, skyrl.ppo.compute_grpo_outcome_advantage(b.rewards.clone(), b.mask, b.uids)[0], **TOL
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_rloo_matches_skyrl_and_verl(skyrl, verl, seed):
    b = make_batch(seed)
    ours = adv.rloo_advantages(b.rewards, b.mask, b.uids)
    sky = skyrl.ppo.compute_rloo_outcome_advantage(b.rewards.clone(), b.mask, b.uids)
    ver = verl.algos.compute_rloo_outcome_advantage(b.rewards.clone(), b.mask, np.array(b.uids))
    for theirs in (sky, ver):
        torch.testing.assert_close(ours[0], theirs[0], **TOL)
    assert torch.all(ours[0][0] == 0)  # the one-sample group


@pytest.mark.parametrize("seed", SEEDS)
def test_maxrl_matches_skyrl(skyrl, seed):
    b = make_batch(seed, sizes=(1, 3, 4, 2, 6, 3))
    zero = slice(16, 19)  # a group whose rewards are all 0: mean 0, advantages 0
    b.rewards[zero] = 0.0
    ours = adv.maxrl_advantages(b.rewards, b.mask, b.uids)
    sky = skyrl.ppo.compute_maxrl_advantage(b.rewards.clone(), b.mask, b.uids)
    torch.testing.assert_close(ours[0], sky[0], **TOL)
    assert torch.all(ours[0][zero] == 0)


def test_index_may_be_a_tensor_or_numpy(skyrl):
    b = make_batch(1)
    ids = torch.tensor([int(u[1:]) for u in b.uids])
    for index in (ids, np.array(b.uids), b.uids):
        torch.testing.assert_close(
            adv.grpo_advantages(b.rewards, b.mask, index)[0],
            skyrl.ppo.compute_grpo_outcome_advantage(b.rewards.clone(), b.mask, b.uids)[0],
        )
    with pytest.raises(ValueError, match="group ids"):
        adv.grpo_advantages(b.rewards, b.mask, b.uids[:-1])


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_reinforce_plus_plus_matches_skyrl(skyrl, seed, gamma):
    b = make_batch(seed)
    b.rewards += 0.1 * torch.randn(b.rewards.shape, generator=torch.Generator().manual_seed(seed))  # dense
    ours = adv.reinforce_plus_plus_advantages(b.rewards, b.mask, gamma=gamma)
    sky = skyrl.ppo.compute_reinforce_plus_plus_outcome_advantage(b.rewards, b.mask, gamma)
    torch.testing.assert_close(ours[0], sky[0], **TOL)
    torch.testing.assert_close(ours[1], sky[1], **TOL)


@pytest.mark.parametrize("seed", SEEDS)
def test_reinforce_plus_plus_matches_verl_on_right_padded_rows(verl, seed):
    """verl carries the return across masked spans where SkyRL restarts it; on right-padded rows with no
    reward in the padding both are the same computation."""
    b = make_batch(seed, holes=False)
    rewards = b.rewards * b.mask
    ours = adv.reinforce_plus_plus_advantages(rewards, b.mask, gamma=0.95)
    ver = verl.algos.compute_reinforce_plus_plus_outcome_advantage(
        rewards, b.mask, config=verl.algos.AlgoConfig(gamma=0.95)
    )
    torch.testing.assert_close(ours[0], ver[0], **TOL)
    torch.testing.assert_close(ours[1] * b.mask, ver[1], **TOL)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize(("gamma", "lambd"), [(1.0, 1.0), (0.99, 0.95)])
def test_gae_matches_skyrl(skyrl, seed, gamma, lambd):
    b = make_batch(seed)
    b.rewards += 0.1 * torch.randn(b.rewards.shape, generator=torch.Generator().manual_seed(seed))
    ours = adv.gae_advantages(b.rewards, b.values, b.mask, gamma=gamma, lambd=lambd)
    sky = skyrl.ppo.compute_gae_advantage_return(b.rewards, b.values, b.mask, gamma, lambd)
    torch.testing.assert_close(ours[0], sky[0], **TOL)
    torch.testing.assert_close(ours[1], sky[1], **TOL)


@pytest.mark.parametrize("seed", SEEDS)
def test_gae_matches_verl_when_values_are_zero_outside_the_response(verl, seed):
    b = make_batch(seed, holes=False)
    values, rewards = b.values * b.mask, b.rewards * b.mask
    ours = adv.gae_advantages(rewards, values, b.mask, gamma=0.99, lambd=0.95)
    ver = verl.algos.compute_gae_advantage_return(rewards, values, b.mask, 0.99, 0.95)
    torch.testing.assert_close(ours[0], ver[0], **TOL)
    torch.testing.assert_close(ours[1], ver[1], **TOL)


@pytest.mark.parametrize("estimator", ["reinforce++", "gae"])
@pytest.mark.parametrize("tokens", [0, 1])
def test_whitening_estimators_refuse_fewer_than_two_tokens(skyrl, estimator, tokens):
    mask = torch.zeros(3, 5)
    mask[1, :tokens] = 1
    rewards, values = torch.rand(3, 5), torch.rand(3, 5)
    with pytest.raises(ValueError, match="at least 2 unmasked"):
        compute_advantages_and_returns(
            estimator, token_level_rewards=rewards, response_mask=mask, index=["a", "b", "c"], values=values
        )
    with pytest.raises(ValueError):  # SkyRL refuses too
        skyrl.ppo.compute_advantages_and_returns(
            rewards, mask, ["a", "b", "c"], estimator, None, values=values
        )


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "maxrl", "reinforce++", "gae"])
def test_registered_estimators_match_skyrls_dispatch(skyrl, estimator):
    """The registry callables, called the way SkyRL's trainer calls its own."""
    b = make_batch(4)
    cfg = skyrl.config.AlgorithmConfig(advantage_estimator=estimator, gamma=0.97, lambd=0.9)
    kwargs = dict(
        token_level_rewards=b.rewards,
        response_mask=b.mask,
        index=b.uids,
        values=b.values,
        grpo_norm_by_std=False,
        gamma=0.97,
        lambd=0.9,
    )
    ours = compute_advantages_and_returns(estimator, config=cfg, **kwargs)
    sky = skyrl.ppo.compute_advantages_and_returns(
        adv_estimator=estimator, config=cfg, **{**kwargs, "token_level_rewards": b.rewards.clone()}
    )
    torch.testing.assert_close(ours[0], sky[0], **TOL)
    torch.testing.assert_close(ours[1], sky[1], **TOL)


def test_gae_needs_values():
    with pytest.raises(ValueError, match="critic's values"):
        compute_advantages_and_returns(
            "gae", token_level_rewards=torch.rand(2, 3), response_mask=torch.ones(2, 3), index=["a", "b"]
        )


@pytest.mark.parametrize("seed", SEEDS)
def test_batch_normalize_matches_skyrls_trainer(skyrl, skyrl_trainer, seed):
    """`advantage_batch_normalize` as SkyRL's trainer applies it (with the per-mini-batch token_mean scaling
    after it, which `test_reductions` checks on its own)."""
    gen = torch.Generator().manual_seed(seed)
    mask = random_mask(gen, 8, 10)
    advantages = torch.randn(8, 10, generator=gen) * mask
    data = skyrl_trainer.batch.TrainingInputBatch(
        {"advantages": advantages.clone(), "response_mask": mask, "loss_mask": mask}
    )
    cfg = skyrl.config.AlgorithmConfig(advantage_batch_normalize=True, loss_reduction="token_mean")
    fake = fake_trainer(cfg, micro_batch_size=2)
    sky = skyrl_trainer.trainer.RayPPOTrainer._normalize_advantages(fake, data, [(0, 8)])["advantages"]
    ours = adv.batch_normalize_advantages(advantages, mask) / mask.sum().clamp(min=1)
    torch.testing.assert_close(ours, sky, **TOL)
    with pytest.raises(ValueError, match="no response token"):
        adv.batch_normalize_advantages(advantages, torch.zeros_like(mask))
