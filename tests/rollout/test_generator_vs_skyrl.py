"""The generator keys against SkyRL's own generator (SkyRL 0.3.0's `SkyRLGymGenerator.agent_loop`, the
oracle): the same scripted engine turns through the same skyrl-gym environment and tokenizer give the
same prompt, response tokens, loss mask, stop reason and per-turn rewards, for
`use_conversation_multi_turn`, `append_eos_token_after_stop_str_in_multi_turn`, `max_input_length`,
`zero_reward_on_non_stop` and `apply_overlong_filtering`.

Two documented differences are spelled out where they apply: a turn's reward sits on the last token
the model sampled (SkyRL puts it on the EOS it appended after a stop string, one token later), and
the EOS that closes an episode whose observations were appended to the response is not trained on
(SkyRL trains on it with a log-probability of 0).
"""

from __future__ import annotations

import asyncio

import pytest
import skyrl_gym
from scripted import ScriptedClient, encode, skyrl_rows, write_parquet
from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput
from skyrl_oracle import import_skyrl, skyrl_episode

from inflight.rollout.task_generator import ENV_VERSION, TaskGenerator
from inflight.tasks import DataTask
from inflight.tasks.skyrl_gym_env import GymSettings
from inflight.testing.tiny_model import make_tokenizer

ENV_ID = "inflight_test_turns"
STOP = "</go>"
MAX_TURNS = 3


class TurnsEnv(BaseTextEnv):
    """Rewards 0.25 per turn number; a user message after every turn until `max_turns`."""

    def __init__(self, env_config=None, extras=None):
        super().__init__()
        self.max_turns = extras["max_turns"]

    def step(self, action: str) -> BaseTextEnvStepOutput:
        self.turns += 1
        done = self.turns >= self.max_turns
        obs = (
            [] if done else [{"role": "user", "content": f"turn {self.turns} ({action[-8:]!r}) noted; go on"}]
        )
        return BaseTextEnvStepOutput(observations=obs, reward=0.25 * self.turns, done=done, metadata={})


if ENV_ID not in skyrl_gym.registry:
    skyrl_gym.register(id=ENV_ID, entry_point=TurnsEnv)


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


@pytest.fixture(scope="module")
def task(tok, tmp_path_factory):
    data = write_parquet(
        tmp_path_factory.mktemp("turns") / "d.parquet", skyrl_rows(f"skyrl_gym:{ENV_ID}", n=1)
    )
    return DataTask(tok, [data], [data], skyrl_gym=GymSettings(None, MAX_TURNS))


def script(tok, last_finish: str) -> list[tuple[list[int], str]]:
    """Three turns: ended by the stop string, by the model's EOS, and by the stop string (or cut by the
    token budget: `last_finish="length"`)."""
    eos = tok.eos_token_id
    last = encode(tok, f"third {STOP}") if last_finish == "stop" else encode(tok, "third and on and on")
    return [
        (encode(tok, f"first step {STOP}"), "stop"),
        (encode(tok, "second") + [eos], "stop"),
        (last, last_finish),
    ]


def ours(task, turns, **keys):
    client = ScriptedClient(turns)
    gen = TaskGenerator(client, task, n=1, max_tokens=64, stop=[STOP], max_turns=MAX_TURNS, **keys)
    return asyncio.run(gen.episode(task.train_problems()[0])), client


def theirs(task, turns, **keys):
    problem = task.train_problems()[0]
    return skyrl_episode(task.tokenizer, turns, problem.prompt, ENV_ID, problem.meta["extras"], stop=[STOP],
                         max_turns=MAX_TURNS, **keys)


def token_rewards(traj) -> list[float]:
    out = [0.0] * len(traj.response_ids)
    for position, reward in traj.turn_rewards:
        out[position] += reward
    return out


def appended(traj, i: int, eos: int) -> bool:
    """Token `i` is an EOS the generator appended (the model did not sample it)."""
    return traj.versions[i] == ENV_VERSION and traj.response_ids[i] == eos


def compare(mine, skyrl, eos: int, conversation: bool) -> None:
    assert mine.prompt_ids == skyrl.prompt_ids
    assert mine.response_ids == skyrl.response_ids
    assert mine.finish_reason == skyrl.stop_reason
    want_mask, want_rewards = list(skyrl.loss_mask), list(skyrl.reward)
    last = len(mine.response_ids) - 1
    if not conversation and appended(mine, last, eos):  # documented: SkyRL trains on its closing EOS
        assert want_mask[last] == 1 and skyrl.rollout_logprobs[last] == 0.0
        want_mask[last] = 0
    assert mine.loss_mask == want_mask
    for i, r in enumerate(list(want_rewards)):  # documented: the reward sits on the sampled token before
        if r and appended(mine, i, eos):
            want_rewards[i - 1], want_rewards[i] = want_rewards[i - 1] + r, 0.0
    assert token_rewards(mine) == pytest.approx(want_rewards)
    assert mine.reward == pytest.approx(sum(skyrl.reward))
    sampled = [i for i, v in enumerate(mine.versions) if v != ENV_VERSION]
    assert [mine.logprobs[i] for i in sampled] == [-0.5] * len(sampled)


@pytest.mark.parametrize("conversation, append_eos", [(True, True), (True, False), (False, True)])
@pytest.mark.parametrize("last_finish", ["stop", "length"])
def test_episodes_match_skyrls_generator(tok, task, conversation, append_eos, last_finish):
    keys = dict(
        use_conversation_multi_turn=conversation, append_eos_token_after_stop_str_in_multi_turn=append_eos
    )
    mine, _ = ours(task, script(tok, last_finish), **keys)
    skyrl = theirs(task, script(tok, last_finish), **keys)
    assert mine.num_turns == MAX_TURNS and len(mine.turn_rewards) == MAX_TURNS
    compare(mine, skyrl, tok.eos_token_id, conversation)


@pytest.mark.parametrize("conversation", [True, False])
def test_max_input_length_ends_the_episode_where_skyrls_does(tok, task, conversation):
    keys = dict(use_conversation_multi_turn=conversation)
    _, client = ours(task, script(tok, "stop"), **keys)
    third_input = len(client.prompts[2])  # what the model saw in the third turn
    for cap, turns in ((third_input, MAX_TURNS), (third_input - 1, 2)):
        mine, _ = ours(task, script(tok, "stop"), max_input_length=cap, **keys)
        skyrl = theirs(task, script(tok, "stop"), max_input_length=cap, **keys)
        assert mine.num_turns == turns and (mine.finish_reason == "length") == (turns < MAX_TURNS)
        compare(mine, skyrl, tok.eos_token_id, conversation)


@pytest.mark.parametrize("last_finish", ["stop", "length"])
def test_zero_reward_and_overlong_filtering_follow_skyrl(tok, task, last_finish):
    utils = import_skyrl("skyrl.train.generators.utils")
    module = import_skyrl("skyrl.train.generators.skyrl_gym_generator")
    mine, _ = ours(
        task, script(tok, last_finish), zero_reward_on_non_stop=True, apply_overlong_filtering=True
    )
    skyrl = theirs(task, script(tok, last_finish))
    [want_reward] = module.SkyRLGymGenerator._zero_reward_if_not_stop(
        None, [list(skyrl.reward)], [skyrl.stop_reason]
    )
    [want_mask] = utils.apply_overlong_filtering([list(skyrl.loss_mask)], [skyrl.stop_reason])
    assert mine.finish_reason == skyrl.stop_reason == last_finish
    assert (
        mine.reward == pytest.approx(sum(want_reward)) and sum(r for _, r in mine.turn_rewards) == mine.reward
    )
    assert mine.loss_mask == want_mask
    assert (mine.reward == 0 and not any(mine.loss_mask)) == (last_finish == "length")
    assert mine.num_sampled == sum(v != ENV_VERSION for v in mine.versions) > 0


def test_the_config_keys_reach_the_generator(task):
    from inflight.config import load_config
    from inflight.rollout.task_generator import episode_options
    from inflight.testing import LOCAL_CPU

    defaults = episode_options(load_config(None, [*LOCAL_CPU, "trainer.max_prompt_length=300"]))
    assert defaults["max_input_length"] == 300  # null: trainer.max_prompt_length, as SkyRL resolves it
    assert (
        defaults["use_conversation_multi_turn"] and defaults["append_eos_token_after_stop_str_in_multi_turn"]
    )
    assert not defaults["zero_reward_on_non_stop"] and not defaults["apply_overlong_filtering"]
    cfg = load_config(
        None,
        [
            *LOCAL_CPU, "generator.max_input_length=4096", "generator.use_conversation_multi_turn=false",
            "generator.append_eos_token_after_stop_str_in_multi_turn=false",
            "generator.zero_reward_on_non_stop=true", "generator.apply_overlong_filtering=true",
        ],
    )
    options = episode_options(cfg)
    assert options["max_input_length"] == 4096 and not options["use_conversation_multi_turn"]
    assert not options["append_eos_token_after_stop_str_in_multi_turn"]
    assert options["zero_reward_on_non_stop"] and options["apply_overlong_filtering"]
    gen = TaskGenerator(None, task, **options)
    assert (gen.max_input_length, gen.conversation, gen.append_eos) == (4096, False, False)

