"""The training step's glue to `inflight.algorithms`: names resolved when the step is built (a user's
registration before counts, `package.module:name` imports), SkyRL's deprecated TIS keys, the
training temperature, token rewards (per turn, the overlong penalty), the response layout."""

from __future__ import annotations

import math

import pytest
import torch
from oracle_import import import_oracle

from inflight.algorithms import (
    ADVANTAGE_ESTIMATORS,
    POLICY_LOSSES,
    register_advantage_estimator,
    register_policy_loss,
)
from inflight.config import ConfigError, load_config
from inflight.config.implemented import require_implemented, unimplemented
from inflight.rollout.trajectory import Trajectory
from inflight.testing import LOCAL_CPU
from inflight.train.advantage_pipeline import ResponseLayout, overlong_penalty, shaped_reward, token_rewards
from inflight.train.batch import plan_micro_batches
from inflight.train.objective import Objective, RLBatch, off_policy_correction, rl_loss, training_temperature

ALG = "trainer.algorithm."


def _cfg(*overrides: str):
    return load_config(None, [*LOCAL_CPU, *overrides])


def test_names_resolve_when_the_objective_is_built():
    objective = Objective.from_config(_cfg(ALG + "advantage_estimator=rloo", ALG + "policy_loss_type=cispo"))
    assert objective.estimator is ADVANTAGE_ESTIMATORS.get(
        "rloo"
    ) and objective.policy_loss is POLICY_LOSSES.get("cispo")
    imported = Objective.from_config(_cfg(ALG + "advantage_estimator=inflight.algorithms.skyrl_calls:maxrl"))
    assert imported.estimator is ADVANTAGE_ESTIMATORS.get("maxrl")


def test_an_unknown_name_validates_but_a_run_refuses_it_naming_the_known_ones():
    cfg = _cfg(ALG + "advantage_estimator=my_estimator")  # validates: user code may register it
    (violation,) = [v for v in unimplemented(cfg) if v.key == ALG + "advantage_estimator"]
    assert (
        "grpo" in violation.rule
        and "no_op" in violation.rule
        and "register_advantage_estimator" in violation.rule
    )
    with pytest.raises(ConfigError):
        require_implemented(cfg)
    with pytest.raises(ValueError, match="use one of grpo"):
        Objective.from_config(cfg)
    with pytest.raises(ConfigError, match="package.module:name"):
        _cfg(ALG + "policy_loss_type=not a:module name")


def test_a_name_registered_before_the_run_counts():
    def constant(*, token_level_rewards, response_mask, **_):
        return response_mask * 2.0, response_mask * 2.0

    register_advantage_estimator("twice_the_mask", constant)
    try:
        cfg = _cfg(ALG + "advantage_estimator=twice_the_mask")
        require_implemented(cfg)
        assert Objective.from_config(cfg).estimator is constant
    finally:
        ADVANTAGE_ESTIMATORS.unregister("twice_the_mask")


def test_the_deprecated_tis_keys_mean_what_skyrl_reads_them_as():
    plain = off_policy_correction(_cfg(ALG + "off_policy_correction.tis_ratio_type=null"))
    assert plain.tis_ratio_type is None
    old = off_policy_correction(_cfg(ALG + "off_policy_correction.tis_ratio_type=null", ALG + "use_tis=true",
                                     ALG + "tis_imp_ratio_cap=3.5"))
    assert old.tis_ratio_type == "token" and old.token_tis_ratio_clip_high == 3.5
    with pytest.raises(ConfigError, match="tis_imp_ratio_cap"):
        _cfg(ALG + "use_tis=true")


def test_the_training_temperature():
    assert training_temperature(_cfg("generator.sampling_params.temperature=0.7")) == 0.7
    assert (
        training_temperature(_cfg("generator.sampling_params.temperature=0.7", ALG + "temperature=1.3"))
        == 1.3
    )
    # greedy: plain logits
    assert training_temperature(_cfg("generator.sampling_params.temperature=0.0")) == 1.0


def _traj(n: int, reward: float, turns=()) -> Trajectory:
    return Trajectory([1, 2], list(range(3, 3 + n)), [0.0] * n, [0] * n, [1] * n, reward, "stop",
                      turn_rewards=list(turns))


def test_token_rewards_per_turn_and_the_overlong_penalty():
    trajs = [_traj(3, 1.0), _traj(5, 1.5, [(1, 0.5), (4, 1.0)]), _traj(8, 1.0), _traj(9, 1.0)]
    layout = ResponseLayout.of(trajs)
    # max_generate_length 8, buffer 4: lengths 3 and 4 pay nothing, 5 pays 1/4, 8 pays 4/4, 9 scores 0
    penalties = [overlong_penalty(len(t.response_ids), 8, 4, 1.0) for t in trajs]
    assert penalties == [0.0, 0.25, 1.0, None]
    assert [shaped_reward(t, p) for t, p in zip(trajs, penalties, strict=True)] == [1.0, 1.25, 0.0, 0.0]
    rewards = token_rewards(trajs, layout, penalties)
    assert rewards[0].tolist() == [0, 0, 1.0, 0, 0, 0, 0, 0, 0]
    assert rewards[1].tolist() == [0, 0.5, 0, 0, 0.75, 0, 0, 0, 0]
    assert rewards[2, 7] == 0.0 and rewards[3].abs().sum() == 0
    assert overlong_penalty(9, 8, None, 1.0) == 0.0
    with pytest.raises(ConfigError, match="overlong_buffer_len"):
        _cfg(ALG + "overlong_buffer_len=99", "generator.sampling_params.max_generate_length=16")


def test_the_response_layout_round_trips():
    trajs = [_traj(2, 0.0), _traj(4, 0.0)]
    trajs[1].prompt_ids = [1, 2, 3]
    layout = ResponseLayout.of(trajs)
    full = torch.arange(14, dtype=torch.float32).reshape(2, 7)
    taken = layout.take(full)
    assert taken.tolist() == [[2, 3, 0, 0], [10, 11, 12, 13]]
    assert layout.put(taken, 7).tolist() == [[0, 0, 2, 3, 0, 0, 0], [0, 0, 0, 10, 11, 12, 13]]
    assert layout.mask().tolist() == [[1, 1, 0, 0], [1, 1, 1, 1]]


@pytest.mark.parametrize("name", ["kl_cov", "clip_cov"])
def test_the_loss_sees_the_batch_s_row_order_whatever_the_micro_batch_s(name):
    """kl_cov's top-k on a zero-variance batch (every advantage 0: every covariance ties) and clip_cov's
    random draw among its candidates pick tokens by position. The step's micro-batch holds its rows
    sorted by length; the loss sees them back in the batch's order, so it equals SkyRL's function (under
    SkyRL's default config) on the batch as SkyRL holds it."""
    ppo = import_oracle("skyrl.backends.skyrl_train.utils.ppo_utils")
    skyrl_config = import_oracle("skyrl.train.config")
    gen = torch.Generator().manual_seed(3)
    lengths = [3, 9, 5, 12, 7, 12, 2, 10]
    mask = (torch.arange(12)[None, :] < torch.tensor(lengths)[:, None]).float()
    old = -3 * torch.rand(8, 12, generator=gen)
    log_probs = old + 0.5 * torch.randn(8, 12, generator=gen)
    advantages = torch.zeros(8, 12) if name == "kl_cov" else 3 * torch.randn(8, 12, generator=gen)
    batch = RLBatch(
        input_ids=torch.zeros(8, 12, dtype=torch.long), loss_mask=mask, attention_mask=mask.long(),
        advantages=advantages, old_logprobs=old,
    )
    (part,) = plan_micro_batches(lengths, max_rows=8, pass_cost=math.inf)  # one micro-batch, longest first
    assert part != sorted(part)
    micro = batch.select(torch.tensor(part))
    objective = Objective.from_config(_cfg(ALG + f"policy_loss_type={name}", ALG + "use_kl_loss=false",
                                           ALG + "off_policy_correction.tis_ratio_type=null"))
    ours_lp, sky_lp = log_probs.clone().requires_grad_(True), log_probs.clone().requires_grad_(True)
    torch.manual_seed(11)
    ours = rl_loss(objective)(ours_lp[part], micro)
    torch.manual_seed(11)
    sky, _ = ppo.PolicyLossRegistry.get(name)(
        sky_lp, old, batch.advantages, skyrl_config.AlgorithmConfig(policy_loss_type=name), loss_mask=mask
    )
    (ours + sky).backward()  # the two graphs are disjoint: each input gets its own loss's gradient
    torch.testing.assert_close(ours.detach(), sky.detach(), rtol=1e-6, atol=0)
    torch.testing.assert_close(ours_lp.grad, sky_lp.grad, rtol=1e-6, atol=0)
    torch.manual_seed(11)  # in the micro-batch's own order, other tokens would be picked
    unordered, _ = objective.policy_loss(log_probs[part], old[part], micro.advantages, objective.config,
                                         loss_mask=micro.loss_mask)
    assert abs(float(unordered - sky.detach())) > 1e-3 * abs(float(sky.detach()))


def test_a_registered_loss_s_traits_drive_validation_and_the_step():
    """What a loss declares when it is registered decides: a correction configured with a loss that
    applies none is refused when the config is validated; a loss that reads no old log-probabilities
    skips that forward; a supervised one gets no entropy (nor KL) term."""
    def plain_pg(log_probs, old_log_probs, advantages, config, loss_mask=None, rollout_logprobs=None):
        return (-(advantages * log_probs) * loss_mask).sum(), {}

    loss, tis = ALG + "policy_loss_type=plain_pg", ALG + "off_policy_correction.tis_ratio_type="
    register_policy_loss("plain_pg", plain_pg, applies_off_policy_correction=False, needs_old_logprobs=False,
                         supervised=True)
    try:
        with pytest.raises(ConfigError, match="plain_pg.*does not apply the off-policy correction"):
            _cfg(loss, tis + "token")
        objective = Objective.from_config(_cfg(loss, tis + "null", ALG + "use_entropy_loss=true"))
        assert not objective.needs_old_logprobs and not rl_loss(objective).wants_entropy
        POLICY_LOSSES.register("plain_pg", plain_pg, override=True)  # the defaults: none of that
        objective = Objective.from_config(_cfg(loss, tis + "token", ALG + "use_entropy_loss=true"))
        assert objective.needs_old_logprobs and rl_loss(objective).wants_entropy
    finally:
        POLICY_LOSSES.unregister("plain_pg")
