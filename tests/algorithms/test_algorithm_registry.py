"""inflight.algorithms.registry: SkyRL's names, user registration by name and `package.module:name`,
SkyRL's own functions working under our registry (same calling conventions), clear errors."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from algorithm_batches import TOL, make_batch

from inflight.algorithms import (
    ADVANTAGE_ESTIMATORS,
    POLICY_LOSSES,
    PolicyLossTraits,
    compute_advantages_and_returns,
    get_advantage_estimator,
    get_policy_loss,
    policy_loss_traits,
    register_advantage_estimator,
    register_policy_loss,
)


def half_reward(*, token_level_rewards, response_mask, **_):
    """A custom estimator in SkyRL's convention: half the reward, token by token."""
    adv = 0.5 * token_level_rewards * response_mask
    return adv, adv


def plain_pg(log_probs, old_log_probs, advantages, config, loss_mask=None, rollout_logprobs=None):
    """A custom policy loss in SkyRL's convention: -A log pi summed over masked tokens."""
    return (-(advantages * log_probs) * loss_mask).sum(), {"clip_ratio": 0.0}


@pytest.fixture
def cleanup():
    names: list[tuple] = []
    yield names
    for registry, name in names:
        if name in registry:
            registry.unregister(name)


def test_every_skyrl_name_is_registered(skyrl):
    assert set(skyrl.ppo.AdvantageEstimatorRegistry.list_available()) <= set(ADVANTAGE_ESTIMATORS.names())
    assert set(skyrl.ppo.PolicyLossRegistry.list_available()) <= set(POLICY_LOSSES.names())


def test_register_an_estimator_by_name(cleanup):
    cleanup.append((ADVANTAGE_ESTIMATORS, "half"))
    assert register_advantage_estimator("half")(half_reward) is half_reward
    b = make_batch(0)
    adv, ret = compute_advantages_and_returns(
        "half", token_level_rewards=b.rewards, response_mask=b.mask, index=b.uids, values=b.values, gamma=0.9
    )
    torch.testing.assert_close(adv, 0.5 * b.rewards * b.mask)
    assert get_advantage_estimator("half") is half_reward


def test_import_by_module_path_without_registering():
    assert get_advantage_estimator("test_algorithm_registry:half_reward") is half_reward
    assert get_policy_loss("test_algorithm_registry:plain_pg") is plain_pg
    assert "test_algorithm_registry:plain_pg" not in POLICY_LOSSES


def test_a_registered_loss_runs_like_a_builtin(skyrl, cleanup):
    cleanup.append((POLICY_LOSSES, "plain_pg"))
    register_policy_loss("plain_pg", plain_pg)
    b = make_batch(1)
    loss, metrics = get_policy_loss("plain_pg")(
        b.log_probs, b.old_log_probs, b.advantages, skyrl.config.AlgorithmConfig(), loss_mask=b.mask
    )
    torch.testing.assert_close(loss, (-(b.advantages * b.log_probs) * b.mask).sum())
    assert metrics == {"clip_ratio": 0.0}


def test_skyrls_own_functions_work_under_our_registry(skyrl, cleanup):
    """Same calling conventions: SkyRL's GRPO and PPO registered here give what ours give."""
    cleanup.extend([(ADVANTAGE_ESTIMATORS, "skyrl_grpo"), (POLICY_LOSSES, "skyrl_regular")])
    register_advantage_estimator("skyrl_grpo", skyrl.ppo.compute_grpo_outcome_advantage)
    register_policy_loss("skyrl_regular", skyrl.ppo.ppo_policy_loss)
    b = make_batch(2)
    kwargs = dict(token_level_rewards=b.rewards, response_mask=b.mask, index=b.uids, values=b.values)
    theirs = compute_advantages_and_returns(
        "skyrl_grpo", **{**kwargs, "token_level_rewards": b.rewards.clone()}
    )
    torch.testing.assert_close(compute_advantages_and_returns("grpo", **kwargs)[0], theirs[0], **TOL)
    cfg = skyrl.config.AlgorithmConfig(policy_loss_type="regular")
    args = (b.log_probs, b.old_log_probs, b.advantages, cfg, b.mask, b.rollout_logprobs)
    torch.testing.assert_close(
        get_policy_loss("regular")(*args)[0], get_policy_loss("skyrl_regular")(*args)[0], **TOL
    )


def test_duplicates_need_override(cleanup):
    cleanup.append((POLICY_LOSSES, "plain_pg"))
    register_policy_loss("plain_pg", plain_pg)
    register_policy_loss("plain_pg", plain_pg)  # the same function again is fine
    with pytest.raises(ValueError, match="already registered.*override=True"):
        register_policy_loss("plain_pg", half_reward)
    register_policy_loss("plain_pg", half_reward, override=True)
    assert get_policy_loss("plain_pg") is half_reward
    with pytest.raises(ValueError, match="already registered"):
        register_policy_loss("regular", plain_pg)


def test_unknown_names_list_the_known_ones():
    with pytest.raises(ValueError) as err:
        get_policy_loss("regullar")
    message = str(err.value)
    assert "trainer.algorithm.policy_loss_type='regullar'" in message and "did you mean 'regular'" in message
    assert all(name in message for name in ("dual_clip", "gspo", "cispo", "kl_cov", "package.module:name"))
    with pytest.raises(ValueError, match="grpo, rloo, maxrl, reinforce\\+\\+, gae"):
        get_advantage_estimator("ppo")


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("no_such_module_xyz:f", "cannot import module 'no_such_module_xyz'"),
        ("math:nope", "has no attribute 'nope'"),
        ("math:pi", "is a float, not a function"),
        (":f", "write 'package.module:name'"),
    ],
)
def test_bad_import_paths(name, message):
    with pytest.raises(ValueError, match=message):
        get_policy_loss(name)


def test_bad_registrations():
    with pytest.raises(ValueError, match="reserved"):
        register_policy_loss("a:b", plain_pg)
    with pytest.raises(TypeError, match="callable"):
        register_policy_loss("x", 3)
    with pytest.raises(ValueError, match="non-empty"):
        register_advantage_estimator("", half_reward)
    with pytest.raises(KeyError, match="no policy loss named 'nothing'"):
        POLICY_LOSSES.unregister("nothing")


def _reacts_to_the_correction(skyrl, name: str) -> bool:
    """Whether SkyRL's own `name` gives another loss when token TIS is configured (clip_cov's draw
    seeded alike)."""
    b = make_batch(4, drift=0.5)
    fn, c = skyrl.ppo.PolicyLossRegistry.get(name), skyrl.config
    losses = []
    for correction in ({}, {"tis_ratio_type": "token", "token_tis_ratio_clip_high": 1.1}):
        cfg = c.AlgorithmConfig(
            policy_loss_type=name, off_policy_correction=c.OffPolicyCorrectionConfig(**correction)
        )
        torch.manual_seed(0)
        losses.append(fn(b.log_probs, b.old_log_probs, b.advantages, cfg, loss_mask=b.mask,
                         rollout_logprobs=b.rollout_logprobs)[0])
    return not torch.equal(losses[0], losses[1])


def test_what_each_built_in_loss_declares_is_what_skyrl_does(skyrl):
    """needs_old_logprobs: SkyRL's LOSSES_WITHOUT_OLD_LOGPROBS; applies_off_policy_correction: SkyRL's
    function reacts to a configured correction; supervised: SkyRL's worker's SFT path (cross_entropy)."""
    names = skyrl.ppo.PolicyLossRegistry.list_available()
    without_old = {str(getattr(n, "value", n)) for n in skyrl.ppo.LOSSES_WITHOUT_OLD_LOGPROBS}
    assert {n for n in names if not policy_loss_traits(n).needs_old_logprobs} == without_old
    for name in names:
        assert (
            policy_loss_traits(name).applies_off_policy_correction == _reacts_to_the_correction(skyrl, name)
        ), name
    assert [n for n in names if policy_loss_traits(n).supervised] == ["cross_entropy"]


def test_a_loss_registers_its_traits_with_itself(cleanup):
    cleanup.append((POLICY_LOSSES, "plain_pg"))
    register_policy_loss("plain_pg", plain_pg, needs_old_logprobs=False, supervised=True)
    assert policy_loss_traits("plain_pg") == PolicyLossTraits(needs_old_logprobs=False, supervised=True)
    assert policy_loss_traits("test_algorithm_registry:plain_pg") == PolicyLossTraits()  # a path: defaults
    with pytest.raises(TypeError, match="unknown trait.*needs_old_logprob.*declares"):
        POLICY_LOSSES.register("plain_pg", plain_pg, override=True, needs_old_logprob=False)
    with pytest.raises(TypeError, match="declares nothing"):
        ADVANTAGE_ESTIMATORS.register("half", half_reward, supervised=True)
    POLICY_LOSSES.unregister("plain_pg")
    assert policy_loss_traits("plain_pg") == PolicyLossTraits()


def test_a_loss_registered_by_path_is_imported_at_its_first_lookup(cleanup):
    cleanup.append((POLICY_LOSSES, "by_path"))
    register_policy_loss("by_path", "test_algorithm_registry:plain_pg", applies_off_policy_correction=False)
    assert not policy_loss_traits("by_path").applies_off_policy_correction
    assert get_policy_loss("by_path") is plain_pg
    register_policy_loss("by_path", "test_algorithm_registry:plain_pg", applies_off_policy_correction=False)
    with pytest.raises(TypeError, match="callable or 'package.module:name'"):
        register_policy_loss("by_path", "not a path")


def test_the_registry_and_its_traits_load_without_torch():
    """Validating a config reads the registry: it must not import torch (seconds)."""
    code = ("import sys\nfrom inflight.algorithms import POLICY_LOSSES, policy_loss_traits\n"
            "assert not policy_loss_traits('kl_cov').applies_off_policy_correction\n"
            "assert 'cispo' in POLICY_LOSSES.names()\nprint('torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"
