"""`generator.step_wise_trajectories` in the training step: one row per turn, groups of unequal sizes,
and advantages equal to SkyRL 0.3.0's own (`RayPPOTrainer.compute_advantages_and_returns` with
`step_wise_trajectories=True`, then its `_normalize_advantages`: the oracle) on the same rewards and
episode / step ids, each side at its own defaults."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from oracle_import import import_oracle
from rl_support import rl_config

from inflight.config import load_config
from inflight.rollout.trajectory import ENV_VERSION, Trajectory, TrajectoryGroup
from inflight.tasks import Problem
from inflight.testing import LOCAL_CPU, make_tiny_model
from inflight.train import LocalPolicyWorker
from inflight.train.advantage_pipeline import ResponseLayout, compute_advantages, token_rewards
from inflight.train.objective import Objective
from inflight.train.step import TrainingStep, rows_of_groups, step_rows

TURNS = [[3, 1, 2, 2], [1, 1, 3, 2], [2, 3, 1, 1]]  # 3 prompts x 4 episodes: turns per episode
STEP_WISE = "generator.step_wise_trajectories=true"


def episode(gen: torch.Generator, turns: int, version: int = 1) -> Trajectory:
    """A multi-turn episode: each turn 2-4 sampled tokens, then (but after the last) a 1-3 token
    observation; a reward on every turn's last sampled token (0, 0.5 or 1)."""
    ids, mask, versions, turn_rewards = [], [], [], []
    for k in range(turns):
        n = int(torch.randint(2, 5, (1,), generator=gen))
        ids += torch.randint(2, 60, (n,), generator=gen).tolist()
        mask += [1] * n
        versions += [version] * n
        turn_rewards.append((len(ids) - 1, float(torch.randint(0, 3, (1,), generator=gen)) / 2))
        if k < turns - 1:
            m = int(torch.randint(1, 4, (1,), generator=gen))
            ids += torch.randint(2, 60, (m,), generator=gen).tolist()
            mask += [0] * m
            versions += [ENV_VERSION] * m
    prompt = [5, 12, *torch.randint(2, 60, (3,), generator=gen).tolist()]
    return Trajectory(prompt, ids, [-1.0] * len(ids), versions, mask, sum(r for _, r in turn_rewards), "stop",
                      num_turns=turns, turn_rewards=turn_rewards)


def make_groups(seed: int = 0, turns=TURNS) -> list[TrajectoryGroup]:
    gen = torch.Generator().manual_seed(seed)
    return [
        TrajectoryGroup(Problem(f"p{g}", "q", "a"), [episode(gen, n) for n in ts])
        for g, ts in enumerate(turns)
    ]


def skyrl_advantages(
    rows: list[Trajectory], uids: list[int], last: list[bool], algorithm, loss_reduction=None
):
    """SkyRL's trainer on the rows: (advantages before and after `_normalize_advantages` over one
    mini-batch, returns), [B, R] in its response layout."""
    trainer = import_oracle("skyrl.train.trainer").RayPPOTrainer
    batch = import_oracle("skyrl.backends.skyrl_train.training_batch").TrainingInputBatch
    layout = ResponseLayout.of(rows)
    rewards = token_rewards(rows, layout, [0.0] * len(rows))
    mask = layout.mask()
    loss_mask = torch.zeros_like(mask)
    for r, t in enumerate(rows):
        loss_mask[r, : len(t.loss_mask)] = torch.tensor(t.loss_mask, dtype=torch.float32)
    data = batch({"rewards": rewards, "response_mask": mask, "loss_mask": loss_mask, "values": None})
    data.metadata = {"uids": [str(u) for u in uids], "is_last_step": last, "avg_response_length": 1.0}
    me = SimpleNamespace(cfg=SimpleNamespace(generator=SimpleNamespace(step_wise_trajectories=True),
                                             trainer=SimpleNamespace(algorithm=algorithm,
                                                                     micro_train_batch_size_per_gpu=1)),
                         all_metrics={})
    data = trainer.compute_advantages_and_returns(me, data)
    raw, returns = data["advantages"].clone(), data["returns"].clone()
    boundaries = import_oracle("skyrl.train.dataset.preprocess").compute_prompt_boundaries(
        data.metadata["uids"]
    )
    scaled = trainer._normalize_advantages(me, data, [(0, len(rows))], boundaries)["advantages"]
    return raw, scaled, returns


def ours(groups, overrides):
    cfg = load_config(None, [*LOCAL_CPU, STEP_WISE, *overrides])
    rows, episodes = step_rows(groups)
    trajs, uids = rows_of_groups(rows, equal=False)
    layout = ResponseLayout.of(trajs)
    loss_mask = torch.zeros(len(trajs), layout.width)
    for r, t in enumerate(trajs):
        loss_mask[r, : len(t.loss_mask)] = torch.tensor(t.loss_mask, dtype=torch.float32)
    adv = compute_advantages(
        Objective.from_config(cfg), token_rewards(trajs, layout, [0.0] * len(trajs)), layout, loss_mask, uids,
        [(0, len(trajs))], cfg.trainer.micro_train_batch_size_per_gpu, episodes=episodes,
    )
    last = [i == len(episodes) - 1 or episodes[i + 1] != e for i, e in enumerate(episodes)]
    return trajs, uids, last, adv


@pytest.mark.parametrize("overrides, skyrl_keys", [
    ([], {}),  # each side's defaults
    (["trainer.algorithm.grpo_norm_by_std=false"], {"grpo_norm_by_std": False}),
    (["trainer.algorithm.advantage_estimator=rloo"], {"advantage_estimator": "rloo"}),
    (["trainer.algorithm.advantage_estimator=maxrl"], {"advantage_estimator": "maxrl"}),
    (["trainer.algorithm.advantage_batch_normalize=true", "trainer.algorithm.loss_reduction=sequence_mean"],
     {"advantage_batch_normalize": True, "loss_reduction": "sequence_mean"}),
])  # fmt: skip
@pytest.mark.parametrize("seed", [0, 1])
def test_step_wise_advantages_are_skyrls(overrides, skyrl_keys, seed):
    groups = make_groups(seed)
    trajs, uids, last, adv = ours(groups, overrides)
    assert len(trajs) == sum(map(sum, TURNS)) and sum(last) == 12
    algorithm = import_oracle("skyrl.train.config").AlgorithmConfig(**skyrl_keys)
    raw, scaled, returns = skyrl_advantages(trajs, uids, last, algorithm)
    tol = dict(rtol=1e-5, atol=1e-6 * float(raw.abs().max()))
    torch.testing.assert_close(adv.raw, raw, **tol)
    torch.testing.assert_close(adv.returns, returns, **tol)
    torch.testing.assert_close(adv.scaled, scaled, **tol)
    # every step of an episode carries its last step's number; earlier turns' rewards do not count
    for r, t in enumerate(trajs):
        if len(t.response_ids):
            assert torch.all(adv.raw[r, : len(t.response_ids)] == adv.raw[r, 0])
    assert any(t.reward for t, is_last in zip(trajs, last, strict=True) if not is_last)


def run_step(tmp_path, groups, overrides) -> tuple[list, dict]:
    """The step on a tiny model: the rows its training passes saw (ids, attention, loss mask,
    advantages) and its metrics."""
    model_dir = make_tiny_model(tmp_path / "m", seed=0)
    cfg, _ = rl_config(
        model_dir,
        tmp_path,
        [
            *overrides, "trainer.train_batch_size=3", "trainer.policy_mini_batch_size=3",
            "generator.n_samples_per_prompt=4", "trainer.algorithm.off_policy_correction.tis_ratio_type=null",
            "trainer.fully_async.num_parallel_generation_workers=6", "trainer.critic_mini_batch_size=3",
        ],
    )
    worker = LocalPolicyWorker(cfg).setup()
    step = TrainingStep(worker, cfg, 0)
    seen, forward_backward = [], worker.forward_backward

    def spy(part, scale):
        if float(scale):
            seen.extend(zip(part.input_ids.tolist(), part.attention_mask.tolist(), part.loss_mask.tolist(),
                            part.advantages.tolist(), strict=True))
        return forward_backward(part, scale)

    worker.forward_backward = spy
    return seen, step(groups, 1)


def test_merged_step_wise_output_trains_each_episode_whole(tmp_path):
    """merge_stepwise_output: turns are token-in/token-out, so each episode merges back whole (SkyRL's
    prefix-aware merge of these steps gives the episode) and trains as without step-wise."""
    groups = make_groups(2)
    merged, metrics = run_step(tmp_path, groups, [STEP_WISE, "generator.merge_stepwise_output=true"])
    plain, _ = run_step(tmp_path / "plain", groups, [])
    assert "step_wise_rows" not in metrics and sorted(merged) == sorted(plain)
    utils = import_oracle("skyrl.train.generators.utils")
    rows, episodes = step_rows(groups)
    trajs, _ = rows_of_groups(rows, equal=False)
    out = utils.merge_stepwise_output(
        {
            "prompt_token_ids": [t.prompt_ids for t in trajs],
            "response_ids": [t.response_ids for t in trajs], "rewards": [t.reward for t in trajs],
            "loss_masks": [t.loss_mask for t in trajs], "stop_reasons": [t.finish_reason for t in trajs],
            "rollout_logprobs": None,
            "trajectory_ids": [
                import_oracle("skyrl.train.generators.base").TrajectoryID(str(e), 0) for e in episodes
            ],
            "is_last_step": [i == len(episodes) - 1 or episodes[i + 1] != e for i, e in enumerate(episodes)],
        }
    )
    whole = [t for g in groups for t in g.trajectories]
    assert out["prompt_token_ids"] == [t.prompt_ids for t in whole]
    assert out["response_ids"] == [t.response_ids for t in whole]
    assert out["loss_masks"] == [t.loss_mask for t in whole]


def test_a_step_wise_step_trains_one_row_per_turn(tmp_path):
    groups = make_groups(2)
    seen, metrics = run_step(tmp_path, groups, [STEP_WISE])
    rows, episodes = step_rows(groups)
    trajs, uids = rows_of_groups(rows, equal=False)
    last = [i == len(episodes) - 1 or episodes[i + 1] != e for i, e in enumerate(episodes)]
    assert metrics["step_wise_rows"] == len(trajs) == sum(map(sum, TURNS)) and metrics["samples"] == 12
    algorithm = import_oracle("skyrl.train.config").AlgorithmConfig()
    _, scaled, _ = skyrl_advantages(trajs, uids, last, algorithm)
    zero_variance = {
        u
        for u in set(uids)
        if len({trajs[i].reward for i in range(len(trajs)) if uids[i] == u and last[i]}) == 1
    }
    trained = {
        tuple(t.prompt_ids + t.response_ids): r for r, t in enumerate(trajs) if uids[r] not in zero_variance
    }
    assert len(seen) == len(trained)  # every turn of every episode with signal, once
    for ids, attention, mask, advantages in seen:
        width = sum(attention)
        r = trained[tuple(ids[:width])]
        t = trajs[r]
        p = len(t.prompt_ids)
        assert mask[p:width] == t.loss_mask and not any(mask[:p])
        want = scaled[r, : len(t.response_ids)] * torch.tensor(t.loss_mask)
        got = torch.tensor(advantages[p:width]) * torch.tensor(t.loss_mask)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6 * float(scaled.abs().max()))
    assert metrics["optimizer_steps"] == 1 and len(zero_variance) < 3


def skyrl_generator_refuses(override: str) -> bool:
    """Whether SkyRL's SkyRLGymGenerator._validate_cfg refuses step-wise trajectories with `override`
    on its defaults."""
    config = import_oracle("skyrl.train.config")
    module = import_oracle("skyrl.train.generators.skyrl_gym_generator")
    utils = import_oracle("skyrl.train.generators.utils")
    cfg = config.GeneratorConfig(step_wise_trajectories=True)
    key, value = override.split("=")
    *path, leaf = key.split(".")[1:]
    node = cfg
    for part in path:
        node = getattr(node, part)
    setattr(node, leaf, value if leaf == "name_or_path" else value == "true")
    me = SimpleNamespace(
        generator_cfg=cfg, batched=cfg.batched, use_conversation_multi_turn=cfg.use_conversation_multi_turn,
        custom_chat_template=utils.get_custom_chat_template(cfg.chat_template),
    )
    try:
        module.SkyRLGymGenerator._validate_cfg(me, cfg)
    except ValueError as err:
        return "step_wise_trajectories" in str(err)
    return False


@pytest.mark.parametrize("override, key", [
    ("trainer.algorithm.advantage_estimator=reinforce++", "trainer.algorithm.advantage_estimator"),
    ("trainer.algorithm.loss_reduction=token_mean_legacy", "trainer.algorithm.loss_reduction"),
    ("generator.batched=true", "generator.batched"),
    ("generator.use_conversation_multi_turn=false", "generator.use_conversation_multi_turn"),
    ("generator.chat_template.name_or_path=qwen3_with_thinking", "generator.chat_template.name_or_path"),
    ("generator.inference_engine.enable_return_routed_experts=true",
     "generator.inference_engine.enable_return_routed_experts"),
])  # fmt: skip
def test_what_skyrl_refuses_beside_step_wise_is_refused_at_validation(override, key):
    from inflight.config import ConfigError

    load_config(None, [*LOCAL_CPU, override])  # fine without step-wise
    with pytest.raises(ConfigError) as err:
        load_config(None, [*LOCAL_CPU, STEP_WISE, override])
    assert [v.key for v in err.value.violations] == [key]
    assert "SkyRL" in str(err.value) and "generator.step_wise_trajectories=false" in str(err.value)
    if key.startswith("generator."):  # SkyRL's generator refuses the same (its _validate_cfg)
        assert skyrl_generator_refuses(override) and not skyrl_generator_refuses("generator.batched=false")
    cfg = load_config(None, [*LOCAL_CPU, STEP_WISE, "generator.merge_stepwise_output=true"])
    assert cfg.generator.step_wise_trajectories and cfg.generator.merge_stepwise_output
