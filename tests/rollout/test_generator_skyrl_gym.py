"""skyrl-gym's `gsm8k_multi_turn` run unchanged through the real generator: on a tiny model and a
real engine (token-in/token-out against the tokenizer's `apply_chat_template`, each sampled token's
rollout log-probability against transformers over the whole trajectory), and with scripted turns
(each turn's reward where it belongs, against skyrl-gym's own environment stepped by hand)."""

from __future__ import annotations

import asyncio

import pytest
import skyrl_gym
import torch
from scripted import ScriptedClient, encode, skyrl_rows, write_parquet
from transformers import AutoTokenizer

from inflight.client import LocalClient
from inflight.engine import AsyncEngine, EngineConfig, LLMEngine
from inflight.rollout.task_generator import ENV_VERSION, TaskGenerator
from inflight.tasks import DataTask
from inflight.tasks.skyrl_gym_env import GymSettings
from inflight.testing.tiny_model import make_tokenizer

MAX_TURNS = 3
STOP = "e"  # a stop string the random model writes within a few tokens: turns end by it


def gym_env(ground_truth: str):
    """skyrl-gym's environment as SkyRL's generator builds it (the oracle)."""
    extras = {"reward_spec": {"method": "rule", "ground_truth": ground_truth}, "extra_info": {},
              "max_turns": MAX_TURNS}
    return skyrl_gym.make("gsm8k_multi_turn", env_config={}, extras=extras)


def runs(traj) -> list[tuple[int, list[int]]]:
    """Maximal stretches of equal loss mask: (mask, token ids)."""
    out: list[tuple[int, list[int]]] = []
    for tok, m in zip(traj.response_ids, traj.loss_mask, strict=True):
        if out and out[-1][0] == m:
            out[-1][1].append(tok)
        else:
            out.append((m, [tok]))
    return out


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory):
    return tiny_model_factory("qwen2", seed=3)


@pytest.fixture(scope="module")
def task(model_dir, tmp_path_factory):
    data = write_parquet(
        tmp_path_factory.mktemp("gym") / "train.parquet", skyrl_rows("gsm8k_multi_turn", n=3)
    )
    return DataTask(AutoTokenizer.from_pretrained(model_dir), [data], [data],
                    skyrl_gym=GymSettings(None, MAX_TURNS))


def test_gsm8k_multi_turn_on_a_real_engine_is_token_in_token_out(model_dir, task, hf_model_factory):
    async def main():
        engine = AsyncEngine(
            LLMEngine(EngineConfig(model=str(model_dir), num_kv_blocks=128, max_num_seqs=32))
        )
        try:
            gen = TaskGenerator(LocalClient(engine), task, n=4, seed=11, max_tokens=8, max_turns=MAX_TURNS,
                                stop=[STOP], max_input_length=512)
            return [await gen(p) for p in task.train_problems()]
        finally:
            await engine.close()

    groups = asyncio.run(main())
    tok, eos = task.tokenizer, task.tokenizer.eos_token_id
    trajs = [(g.problem, t) for g in groups for t in g.trajectories]
    assert sum(t.num_turns > 1 for _, t in trajs) >= 4, [t.num_turns for _, t in trajs]
    stopped_by_string = 0
    for problem, t in trajs:
        assert t.prompt_ids == list(tok.apply_chat_template(problem.prompt, add_generation_prompt=True,
                                                            return_dict=True)["input_ids"])
        assert 1 <= t.num_turns <= MAX_TURNS and len(t.turn_rewards) == t.num_turns
        env, history = gym_env(problem.answer), list(problem.prompt)
        env.init(history)
        pieces = runs(t)
        for k in range(t.num_turns):
            sampled = pieces[2 * k][1]
            text = tok.decode(sampled, skip_special_tokens=True)
            cut = text.find(STOP)
            oracle = env.step(text[: cut + 1] if cut >= 0 else text)  # what skyrl-gym answers that turn
            position, reward = t.turn_rewards[k]
            assert reward == oracle["reward"] and position == sum(len(p) for _, p in pieces[: 2 * k + 1]) - 1
            if k + 1 == t.num_turns:
                assert oracle["done"] or t.finish_reason == "length"
                break
            assert not oracle["done"]
            # the stretch after the turn (mask 0): the template's end of turn (the EOS appended after the
            # stop string; none when the model sampled it), the environment's message, the generation prompt
            between = pieces[2 * k + 1][1]
            before = tok.apply_chat_template(history, tokenize=False, add_generation_prompt=True) + text
            history += [{"role": "assistant", "content": text}, *oracle["observations"]]
            after = tok.apply_chat_template(history, tokenize=False, add_generation_prompt=True)
            want = encode(tok, after[len(before):])
            assert after.startswith(before) and want[0] == eos
            assert between == (want[1:] if sampled[-1] == eos else want)
            stopped_by_string += sampled[-1] != eos
        masked = [i for i, m in enumerate(t.loss_mask) if m == 0]
        assert all(t.versions[i] == ENV_VERSION and t.logprobs[i] == 0.0 for i in masked)
        assert t.reward == pytest.approx(sum(r for _, r in t.turn_rewards))
    assert stopped_by_string >= 3  # turns that got the appended EOS
    # every sampled token's rollout log-probability is the model's over the whole trajectory
    model = hf_model_factory(model_dir)
    for _, t in trajs:
        ids = torch.tensor([t.prompt_ids + t.response_ids])
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)
        start = len(t.prompt_ids) - 1
        got = logp[torch.arange(start, ids.shape[1] - 1), ids[0, 1:][start:]]
        mask = torch.tensor(t.loss_mask, dtype=torch.bool)
        torch.testing.assert_close(got[mask], torch.tensor(t.logprobs)[mask], atol=2e-4, rtol=1e-4)


def test_each_turns_reward_sits_on_its_last_sampled_token(tmp_path):
    tok = make_tokenizer()
    eos = tok.eos_token_id
    row = skyrl_rows("gsm8k_multi_turn", n=1)[0]
    data = write_parquet(tmp_path / "one.parquet", [row])
    task = DataTask(tok, [data], [data], skyrl_gym=GymSettings(None, MAX_TURNS))
    problem = task.train_problems()[0]
    turns = ["so #### 7", "no answer here", "#### 1"]
    client = ScriptedClient([(encode(tok, text) + [eos], "stop") for text in turns])
    traj = asyncio.run(TaskGenerator(client, task, n=1, max_tokens=32).episode(problem))
    env = gym_env("1")
    env.init(row["prompt"])
    want = [env.step(text)["reward"] for text in turns]
    assert want == [pytest.approx(0.2 / MAX_TURNS), 0, 1.0]  # format score, nothing, correct
    assert [r for _, r in traj.turn_rewards] == want and traj.reward == pytest.approx(sum(want))
    ends = [i for i, (m, nxt) in enumerate(zip(traj.loss_mask, [*traj.loss_mask[1:], 0], strict=True))
            if m == 1 and nxt == 0]
    assert [i for i, _ in traj.turn_rewards] == ends  # each turn's last sampled token (its EOS)
    assert all(traj.response_ids[i] == eos for i in ends)
    assert traj.num_turns == 3 and traj.info["env_metrics"] == {"steps": 3}
