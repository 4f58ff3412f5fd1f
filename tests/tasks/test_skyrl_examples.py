"""The environments SkyRL's example entry points register (`inflight.tasks.skyrl_examples`), by their
ids in rows as SkyRL's example datasets write them, played through `DataTask` and the generator."""

from __future__ import annotations

import asyncio

import pytest
from gym_support import ScriptedClient, encode, write_rows

from inflight.config import load_config
from inflight.config.implemented import unimplemented
from inflight.rollout.generator import TaskGenerator
from inflight.tasks import DataTask
from inflight.tasks.skyrl_examples import MultiplyEnv, first_boxed
from inflight.tasks.skyrl_gym_env import GymSettings
from inflight.testing import LOCAL_CPU
from inflight.testing.tiny_model import make_tokenizer


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


def multiply_rows(product: str = "42") -> list[dict]:
    """Rows as SkyRL's examples/train/multiply/multiply_dataset.py writes them."""
    return [{"data_source": "synthetic_multiply", "env_class": "multiply",
             "prompt": [{"role": "system", "content": "Put your final answer in \\boxed{answer} format."},
                        {"role": "user", "content": "6 * 7"}],
             "reward_spec": {"method": "rule", "ground_truth": product},
             "extra_info": {"num_digits": 1, "split": "train"}}] * 2


def play(task, tok, texts: list[str]):
    client = ScriptedClient([(encode(tok, t) + [tok.eos_token_id], "stop") for t in texts])
    return asyncio.run(TaskGenerator(client, task, n=1, max_tokens=64).episode(task.train_problems()[0])), client


@pytest.mark.parametrize(("answer", "reward"), [("so \\boxed{42}.", 1.0), ("\\boxed{ 42 }", 1.0),
                                                ("\\boxed{41} or \\boxed{42}", 0.5), ("42", 0.0)])
def test_multiply_scores_the_first_boxed_answer_in_one_turn(tok, tmp_path, answer, reward):
    data = write_rows(tmp_path / "multiply.parquet", multiply_rows())
    task = DataTask(tok, [data], [data], skyrl_gym=GymSettings(max_turns=1))
    assert task.report.rewards == {"multiply": 4}
    traj, _ = play(task, tok, [answer])
    assert traj.num_turns == 1 and traj.reward == reward


def test_multiply_gives_feedback_until_the_product_or_the_last_turn(tok, tmp_path):
    data = write_rows(tmp_path / "multiply.parquet", multiply_rows())
    task = DataTask(tok, [data], [data], skyrl_gym=GymSettings(max_turns=3))
    traj, client = play(task, tok, ["it is 42", "\\boxed{40}", "\\boxed{42}", "never asked"])
    assert traj.num_turns == 3 and len(client.prompts) == 3  # the product ended the episode
    assert [r for _, r in traj.turn_rewards] == [0.0, 0.0, 1.0]  # earlier turns score 0
    first, second = (tok.decode(client.prompts[k][len(traj.prompt_ids):]) for k in (1, 2))
    assert "\\boxed{your_answer}" in first and "'40' is not the product" in second
    last, _ = play(task, tok, ["no", "\\boxed{1}", "\\boxed{2}"])
    assert last.num_turns == 3 and [r for _, r in last.turn_rewards] == [0.0, 0.0, 0.5]  # out of turns


def test_multiply_needs_the_ground_truth_and_defaults_to_five_turns():
    with pytest.raises(ValueError, match="reward_spec.ground_truth"):
        MultiplyEnv({}, {"reward_spec": {"method": "rule"}})
    env = MultiplyEnv({}, {"reward_spec": {"ground_truth": 6}})
    assert env.max_turns == 5
    assert [env.step("\\boxed{5}")["done"] for _ in range(5)] == [False] * 4 + [True]
    assert first_boxed("\\boxed{}") is None and first_boxed("\\boxed{12") is None


def test_skyrls_multiply_script_is_not_refused():
    cfg = load_config(None, [*LOCAL_CPU, "environment.env_class=multiply"])
    assert unimplemented(cfg) == []
