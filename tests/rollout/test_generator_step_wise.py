"""`generator.step_wise_trajectories`: an episode's samples, one per model turn (`Trajectory.steps`),
against SkyRL 0.3.0's own step-wise generator (`SkyRLGymGenerator.agent_loop` with
`step_wise_trajectories=True`, the oracle): the same scripted engine turns through the same
skyrl-gym environment and tokenizer give the same prompts, responses (the turn and the observation
after it), loss masks, stop reasons and per-step rewards.

Two documented differences are spelled out where they apply: a turn's reward sits on the last token
the model sampled (SkyRL puts it on the EOS it appended after a stop string, one token later), and a
turn left open after a stop string (`append_eos_token_after_stop_str_in_multi_turn=false`) stays open
in the next step's prompt, which is what the engine was given (SkyRL re-renders the conversation for
each step, and its template closes the turn with the EOS).
"""

from __future__ import annotations

import pytest
from scripted import skyrl_rows, write_parquet
from test_generator_vs_skyrl import ENV_ID, MAX_TURNS, appended, ours, script, theirs

from inflight.rollout.task_generator import ENV_VERSION
from inflight.rollout.trajectory import Trajectory
from inflight.tasks import DataTask
from inflight.tasks.skyrl_gym_env import GymSettings
from inflight.testing.tiny_model import make_tokenizer


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


@pytest.fixture(scope="module")
def task(tok, tmp_path_factory):
    data = write_parquet(
        tmp_path_factory.mktemp("turns") / "d.parquet", skyrl_rows(f"skyrl_gym:{ENV_ID}", n=1)
    )
    return DataTask(tok, [data], [data], skyrl_gym=GymSettings(None, MAX_TURNS))


def closing_eos(theirs: list[int], mine: list[int], eos: int) -> int:
    """How many EOS tokens `theirs` has that `mine` has not, when that is the only difference."""
    i = j = extra = 0
    while i < len(theirs):
        if j < len(mine) and theirs[i] == mine[j]:
            j += 1
        elif theirs[i] == eos:
            extra += 1
        else:
            raise AssertionError(
                f"the prompts differ at {i} by more than an EOS: {theirs[i]} vs {mine[j : j + 1]}"
            )
        i += 1
    assert j == len(mine)
    return extra


def step_rewards(step: Trajectory) -> list[float]:
    out = [0.0] * len(step.response_ids)
    for position, reward in step.turn_rewards:
        out[position] += reward
    return out


@pytest.mark.parametrize("append_eos", [True, False])
@pytest.mark.parametrize("last_finish", ["stop", "length"])
def test_one_sample_per_turn_as_skyrls_step_wise_generator(tok, task, append_eos, last_finish):
    keys = dict(append_eos_token_after_stop_str_in_multi_turn=append_eos)
    episode, client = ours(task, script(tok, last_finish), **keys)
    skyrl = theirs(task, script(tok, last_finish), step_wise_trajectories=True, **keys).step_outputs
    steps = episode.steps()
    assert len(steps) == len(skyrl) == MAX_TURNS
    eos = tok.eos_token_id
    for k, (mine, want) in enumerate(zip(steps, skyrl, strict=True)):
        assert mine.prompt_ids == client.prompts[k]  # what the engine was given for the turn
        if append_eos:
            assert mine.prompt_ids == want.prompt_ids
        else:  # documented: SkyRL's re-rendered prompt closes the first turn (ended by the stop string;
            # the second ends with the model's own EOS) with the EOS
            assert closing_eos(want.prompt_ids, mine.prompt_ids, eos) == min(k, 1)
        assert mine.response_ids == want.response_ids and mine.loss_mask == want.loss_mask
        assert mine.finish_reason == want.stop_reason
        rewards = list(want.reward)
        for i, r in enumerate(list(rewards)):  # documented: the reward sits on the sampled token before
            if r and appended(mine, i, eos):
                rewards[i - 1], rewards[i] = rewards[i - 1] + r, 0.0
        assert step_rewards(mine) == pytest.approx(rewards) and mine.reward == pytest.approx(sum(want.reward))
        sampled = [i for i, v in enumerate(mine.versions) if v != ENV_VERSION]
        assert [mine.logprobs[i] for i in sampled] == [-0.5] * len(sampled)
    # the steps put back together are the episode
    assert steps[-1].prompt_ids + steps[-1].response_ids == episode.prompt_ids + episode.response_ids
    assert [m for s in steps for m in s.loss_mask] == episode.loss_mask
    assert sum(s.reward for s in steps) == pytest.approx(episode.reward)
