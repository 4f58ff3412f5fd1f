"""The critic of `advantage_estimator=gae`: the value model (a transformers backbone and a value head
read from the checkpoint or drawn as SkyRL draws it, values aligned with log-probabilities), and the
step with it: the policy's gradient is the one GAE's advantages over the critic's values give, the
critic's loss is SkyRL's clipped value loss on the batch, and one step moves the values toward the
returns."""

from __future__ import annotations

import pytest
import torch
from objective_support import BASE, direct_grads, make_groups, step_grads
from rl_support import rl_config
from transformers import AutoModel

from inflight.algorithms import gae_advantages, value_loss
from inflight.testing import make_tiny_model
from inflight.train.checkpoint import save_model_dir
from inflight.train.critic import LocalCriticWorker
from inflight.train.step import build_batch

ALG = "trainer.algorithm."


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("critic") / "m", seed=0)


@pytest.fixture(scope="module")
def groups(model_dir):
    return make_groups(model_dir, 0)


def _gae(model_dir, out, *extra):
    overrides = [ALG + "advantage_estimator=gae", ALG + "lambd=0.9", ALG + "gamma=0.95",
                 f"trainer.critic.model.path={model_dir}", "trainer.critic.optimizer_config.lr=1e-2", *extra]
    cfg, _ = rl_config(model_dir, out, [*BASE, *overrides])
    return cfg, overrides


def test_values_are_the_head_on_the_state_before_each_token(model_dir, groups, tmp_path):
    cfg, _ = _gae(model_dir, tmp_path)
    critic = LocalCriticWorker(cfg, model_path=str(model_dir)).setup()
    head = critic.model.value_head.weight
    hidden = critic.model.config.hidden_size
    assert head.shape == (1, hidden) and critic.model.value_head.bias is None
    # SkyRL's draw, no checkpoint head
    assert float(head.detach().std()) == pytest.approx(1 / (hidden + 1), rel=0.3)
    batch = build_batch(groups, None, 0)
    values = critic.values(batch)
    with torch.no_grad():
        states = AutoModel.from_pretrained(model_dir)(input_ids=batch.input_ids,
                                                      attention_mask=batch.attention_mask).last_hidden_state
    torch.testing.assert_close(values[:, 1:], (states @ head.T).squeeze(-1)[:, :-1], atol=1e-5, rtol=0)
    assert (values[:, 0] == 0).all()


def test_a_saved_critic_loads_its_own_head(model_dir, groups, tmp_path):
    cfg, _ = _gae(model_dir, tmp_path)
    critic = LocalCriticWorker(cfg, model_path=str(model_dir)).setup()
    with torch.no_grad():
        critic.model.value_head.weight.mul_(-3.0)
        critic.model.model.norm.weight.add_(0.5)
    save_model_dir(critic, model_dir, tmp_path / "critic")
    again = LocalCriticWorker(cfg, model_path=str(tmp_path / "critic")).setup()
    batch = build_batch(groups, None, 0)
    torch.testing.assert_close(again.values(batch), critic.values(batch), atol=1e-6, rtol=0)


def test_the_gae_step_trains_the_critic_toward_the_returns_and_the_policy_on_gae(model_dir, groups, tmp_path):
    cfg, overrides = _gae(model_dir, tmp_path)
    batch = build_batch(groups, None, 0)
    values = LocalCriticWorker(cfg, model_path=str(model_dir)).setup().values(batch)
    mask = batch.loss_mask.clone()
    mask[8:] = 0  # the third group has no signal: zero-variance filter
    trajs = [t for g in groups for t in g.trajectories]
    # GAE over the responses (values and rewards 0 outside them), SkyRL's returns
    starts, ends = (
        [len(t.prompt_ids) for t in trajs],
        [len(t.prompt_ids) + len(t.response_ids) for t in trajs],
    )
    width = max(e - s for s, e in zip(starts, ends, strict=True))
    rewards, response, lmask, critic_values = (torch.zeros(len(trajs), width) for _ in range(4))
    for r, (s, e, t) in enumerate(zip(starts, ends, trajs, strict=True)):
        rewards[r, e - s - 1], response[r, : e - s] = t.reward, 1.0
        lmask[r, : e - s], critic_values[r, : e - s] = mask[r, s:e], values[r, s:e]
    _, returns = gae_advantages(rewards, critic_values, response, gamma=0.95, lambd=0.9)
    want_loss, _ = value_loss(critic_values, critic_values, returns, lmask, cfg.trainer.algorithm.value_clip)

    critic = LocalCriticWorker(cfg, model_path=str(model_dir)).setup()
    got, metrics = step_grads(model_dir, tmp_path, overrides, groups, 0, critic=critic)
    for a, b in zip(got, direct_grads(model_dir, tmp_path, overrides, groups, values=values), strict=True):
        torch.testing.assert_close(a, b, atol=2e-6, rtol=1e-4)
    assert metrics["critic/critic_loss"] == pytest.approx(float(want_loss), rel=1e-5)
    assert metrics["critic/grad_norm"] > 0 and "critic/values_clipfrac" in metrics
    after = torch.zeros_like(critic_values)
    new = critic.values(batch)
    for r, (s, e) in enumerate(zip(starts, ends, strict=True)):
        after[r, : e - s] = new[r, s:e]
    error = lambda v: float((((v - returns) ** 2) * lmask).sum())  # noqa: E731
    assert error(after) < 0.9 * error(critic_values)
