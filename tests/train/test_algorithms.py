"""Advantages, the PPO-clip loss, truncated importance sampling, loss reductions and the KL penalty
against hand-computed values and torch autograd; the shared training step's micro-batching."""

from __future__ import annotations

import math

import pytest
import torch

from inflight.train.algorithms import (
    RLBatch,
    group_advantages,
    informative_groups,
    kl_k3,
    ppo_clip_terms,
    reduce_loss,
    rl_loss,
    truncated_is_weights,
)


def test_grpo_advantages_by_hand():
    adv = group_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0]]))
    std = math.sqrt((4 * 0.25) / 3)  # unbiased
    torch.testing.assert_close(adv, torch.tensor([[0.5, -0.5, -0.5, 0.5]]) / (std + 1e-6))
    centred = group_advantages(torch.tensor([[3.0, 1.0]]), norm_by_std=False)
    torch.testing.assert_close(centred, torch.tensor([[1.0, -1.0]]))


def test_rloo_advantages_by_hand():
    adv = group_advantages(torch.tensor([[1.0, 0.0, 0.0, 0.0]]), "rloo")
    torch.testing.assert_close(adv, torch.tensor([[1.0, -1 / 3, -1 / 3, -1 / 3]]))
    with pytest.raises(ValueError):
        group_advantages(torch.tensor([[1.0]]), "rloo")
    with pytest.raises(ValueError, match="unknown advantage"):
        group_advantages(torch.tensor([[1.0, 0.0]]), "ppo")


def test_zero_advantage_groups():
    rewards = torch.tensor([[1.0, 1.0, 1.0], [0.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    assert informative_groups(rewards).tolist() == [False, True, False]
    adv = group_advantages(rewards)
    assert adv[0].abs().sum() == 0 and adv[2].abs().sum() == 0


def test_ppo_clip_by_hand():
    lp = torch.log(torch.tensor([[0.5, 0.5, 0.3, 0.3]]))
    old = torch.log(torch.tensor([[0.4, 0.4, 0.4, 0.4]]))
    adv = torch.tensor([[1.0, -1.0, 1.0, -1.0]])
    loss, ratio, clipped = ppo_clip_terms(lp, old, adv, 0.2, 0.2)
    # ratios 1.25 (clipped to 1.2 for A > 0, kept for A < 0), 0.75 (kept for A > 0, clipped to 0.8 for A < 0)
    torch.testing.assert_close(ratio, torch.tensor([[1.25, 1.25, 0.75, 0.75]]))
    torch.testing.assert_close(loss, torch.tensor([[-1.2, 1.25, -0.75, 0.8]]))
    assert clipped.tolist() == [[True, False, False, True]]


def test_rl_loss_token_mean_and_gradient_match_autograd():
    torch.manual_seed(0)
    lp = torch.randn(2, 5).mul(0.1).sub(1.0).requires_grad_(True)
    old = lp.detach() + torch.randn(2, 5) * 0.3
    mask = torch.tensor([[0, 1, 1, 1, 0], [0, 0, 1, 1, 1]], dtype=torch.float32)
    adv = torch.tensor([1.5, -0.5])
    batch = RLBatch(input_ids=torch.zeros(2, 5, dtype=torch.long), loss_mask=mask, advantages=adv, old_logprobs=old)
    loss = rl_loss(0.2, 0.28)(lp, batch)
    ratio = torch.exp(lp - old)
    a = adv[:, None].expand(2, 5)
    want = (-torch.minimum(ratio * a, ratio.clamp(0.8, 1.28) * a) * mask).sum() / mask.sum()
    torch.testing.assert_close(loss, want)
    (grad,) = torch.autograd.grad(loss, lp)
    # by hand: d/dlp of -ratio * A is -ratio * A where the unclipped term is the minimum, else 0
    unclipped_active = (ratio * a) <= (ratio.clamp(0.8, 1.28) * a)
    manual = torch.where(unclipped_active, -ratio * a, torch.zeros_like(a)) * mask / mask.sum()
    torch.testing.assert_close(grad, manual.detach())


def test_truncated_is_weights_token_and_sequence():
    prox = torch.log(torch.tensor([[0.6, 0.1, 0.5]]))
    rollout = torch.log(torch.tensor([[0.2, 0.2, 0.5]]))
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    token = truncated_is_weights(prox, rollout, mask, "token", cap=2.0)
    torch.testing.assert_close(token, torch.tensor([[2.0, 0.5, 1.0]]))  # 3 -> capped at 2; 0.5; unmasked 1
    seq = truncated_is_weights(prox, rollout, mask, "sequence", cap=2.0)
    torch.testing.assert_close(seq, torch.tensor([[1.5, 1.5, 1.0]]))  # 3 * 0.5 on the masked tokens
    seq_capped = truncated_is_weights(prox, rollout, mask, "sequence", cap=1.2)
    torch.testing.assert_close(seq_capped, torch.tensor([[1.2, 1.2, 1.0]]))
    torch.testing.assert_close(truncated_is_weights(prox, rollout, mask, "none"), torch.ones(1, 3))
    with pytest.raises(ValueError):
        truncated_is_weights(prox, rollout, mask, "tokens")


def test_is_weights_scale_the_loss():
    lp = torch.zeros(1, 3, requires_grad=True)
    mask = torch.tensor([[0.0, 1.0, 1.0]])
    base = RLBatch(input_ids=torch.zeros(1, 3, dtype=torch.long), loss_mask=mask, advantages=torch.tensor([1.0]),
                   old_logprobs=torch.zeros(1, 3))
    weighted = RLBatch(**{**base.__dict__, "is_weights": torch.tensor([[1.0, 2.0, 0.5]])})
    fn = rl_loss()
    torch.testing.assert_close(fn(lp, base), torch.tensor(-1.0))
    torch.testing.assert_close(fn(lp, weighted), torch.tensor(-(2.0 + 0.5) / 2))


def test_loss_reductions_by_hand():
    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    torch.testing.assert_close(reduce_loss(values, mask, "token_mean"), torch.tensor(10.0 / 4))
    torch.testing.assert_close(reduce_loss(values, mask, "sequence_mean"), torch.tensor((2.0 + 4.0) / 2))
    torch.testing.assert_close(reduce_loss(values, mask, "seq_mean_token_sum_norm"), torch.tensor((6 / 3 + 4 / 3) / 2))
    with pytest.raises(ValueError):
        reduce_loss(values, mask, "sum")


def test_token_sum_norm_is_the_given_divisor():
    """`seq_mean_token_sum_norm` divides by the given per-row divisor (its mini-batch's longest
    response), so a micro-batch or a rank's share is reduced as within the whole mini-batch."""
    values = torch.tensor([[4.0, 0.0], [1.0, 1.0]])
    mask = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    norm = torch.tensor([5.0, 5.0])
    got = reduce_loss(values[:1], mask[:1], "seq_mean_token_sum_norm", norm[:1])
    torch.testing.assert_close(got, torch.tensor(4.0 / 5))
    batch = RLBatch(input_ids=torch.zeros(2, 2, dtype=torch.long), loss_mask=mask, advantages=torch.ones(2),
                    old_logprobs=torch.zeros(2, 2), token_sum_norm=norm)
    lp = torch.zeros(2, 2)
    fn = rl_loss(reduction="seq_mean_token_sum_norm")
    torch.testing.assert_close(fn(lp, batch), torch.tensor(-(1 / 5 + 2 / 5) / 2))


def test_kl_k3():
    lp = torch.log(torch.tensor([0.5, 0.2]))
    ref = torch.log(torch.tensor([0.25, 0.2]))
    kl = kl_k3(lp, ref)
    torch.testing.assert_close(kl, torch.tensor([0.5 - math.log(0.5) - 1, 0.0]))
    assert (kl >= 0).all()
    lp2 = lp.clone().requires_grad_(True)
    batch = RLBatch(input_ids=torch.zeros(1, 2, dtype=torch.long), loss_mask=torch.ones(1, 2),
                    advantages=torch.zeros(1), old_logprobs=lp.detach()[None], ref_logprobs=ref[None])
    fn = rl_loss(kl_coef=0.1)
    torch.testing.assert_close(fn(lp2[None], batch), 0.1 * kl.mean())
    assert fn.stats["kl"] == pytest.approx(float(kl.mean()))


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_in_forward_tis_equals_a_separate_proximal_forward(level):
    """With one optimizer step per batch the training forward is the proximal policy: computing the
    TIS weights inside the loss gives the gradient of the explicit proximal-forward path."""
    torch.manual_seed(1)
    lp = (torch.randn(3, 6) * 0.2 - 1.0).requires_grad_(True)
    rollout = lp.detach() + torch.randn(3, 6) * 0.5
    mask = (torch.rand(3, 6) > 0.3).float()
    adv = torch.tensor([1.0, -0.7, 0.3])
    ids = torch.zeros(3, 6, dtype=torch.long)
    fn = rl_loss(tis=level, tis_cap=1.5)
    in_forward = RLBatch(input_ids=ids, loss_mask=mask, advantages=adv, old_logprobs=None, rollout_logprobs=rollout)
    (g1,) = torch.autograd.grad(fn(lp, in_forward), lp)
    stats = dict(fn.stats)
    weights = truncated_is_weights(lp.detach(), rollout, mask, level, 1.5)
    explicit = RLBatch(input_ids=ids, loss_mask=mask, advantages=adv, old_logprobs=lp.detach(),
                       rollout_logprobs=rollout, is_weights=weights)
    (g2,) = torch.autograd.grad(fn(lp, explicit), lp)
    torch.testing.assert_close(g1, g2)
    raw = torch.exp(lp.detach() - rollout)[mask > 0]
    assert stats["is_ratio_max"] == pytest.approx(float(raw.max()))
    assert stats["is_truncated_fraction"] == pytest.approx(float((raw > 1.5).float().mean()))
