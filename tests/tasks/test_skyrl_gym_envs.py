"""skyrl-gym's environments by name in `DataTask`, with what they need built in the test: text2sql on
a tiny SQLite database, search against a local retriever, aime, your own `skyrl_gym.Env` class (with
the `environment.skyrl_gym` section of the id it registers, as SkyRL's llm_as_a_judge example does),
the `max_env_workers` bound, and our `gsm8k` against skyrl-gym's GSM8kEnv on a set of responses."""

from __future__ import annotations

import asyncio
import json
import sqlite3
import sys
import textwrap
import threading
import time

import pytest
import skyrl_gym
from gym_support import SINGERS, Retriever, ScriptedClient, encode, make_spider_db, write_rows

from inflight.config import load_config
from inflight.rewards import get_reward
from inflight.rollout.task_generator import TaskGenerator
from inflight.tasks import DataTask
from inflight.tasks.skyrl_gym_env import GymSettings
from inflight.testing import LOCAL_CPU
from inflight.testing.tiny_model import make_tokenizer

SQL_STOPS = ["</sql>", "</solution>"]
GOLD = "SELECT name FROM singer WHERE age > 30"


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


def gym(*overrides: str, max_turns: int = 4) -> GymSettings:
    """The run's `environment.skyrl_gym` section (from a config) and `generator.max_turns`."""
    cfg = load_config(None, [*LOCAL_CPU, *overrides])
    return GymSettings(cfg.environment.skyrl_gym, max_turns)


def play(task, tok, texts, **options):
    eos = tok.eos_token_id
    client = ScriptedClient([(encode(tok, t) + ([] if t.endswith(">") else [eos]), "stop") for t in texts])
    gen = TaskGenerator(client, task, n=1, max_tokens=64, **options)
    return asyncio.run(gen.episode(task.train_problems()[0])), client


def sql_rows(db_id: str = "concert", data: str = "spider") -> list[dict]:
    return [{"data_source": "synsql", "prompt": [{"role": "user", "content": "Singers over 30?"}],
             "env_class": "text2sql", "reward_spec": {"method": "rule", "ground_truth": GOLD},
             "db_id": db_id, "data": data, "extra_info": {"index": 0}}] * 2


def test_text2sql_runs_the_models_sql_on_the_database_and_scores_the_solution(tok, tmp_path):
    root = make_spider_db(tmp_path / "sql_data")
    data = write_rows(tmp_path / "sql.parquet", sql_rows())
    task = DataTask(tok, [data], [data], skyrl_gym=gym(f"environment.skyrl_gym.text2sql.db_path={root}"))
    assert task.report.rewards == {"text2sql": 4}
    with sqlite3.connect(root / "spider/database/concert/concert.sqlite") as conn:  # the oracle
        over_30 = {name for (name,) in conn.execute(GOLD)}
    assert over_30 == {name for name, age in SINGERS if age > 30}
    for solution, reward in ((GOLD, 1.0), ("SELECT name FROM singer", 0.0)):
        turns = [f"<think>look</think><sql>{GOLD}</sql>", f"<think>so</think><solution>{solution}</solution>"]
        traj, client = play(task, tok, turns, stop=SQL_STOPS, use_conversation_multi_turn=False)
        observation = tok.decode(client.prompts[1][len(traj.prompt_ids):])
        assert observation.startswith(turns[0]) and "<observation>" in observation  # the model's SQL ran
        assert all(name in observation for name in over_30)
        assert not any(name in observation for name, age in SINGERS if age <= 30)
        assert traj.num_turns == 2 and traj.turn_rewards[0][1] == 0.0 and traj.reward == reward


def test_search_queries_the_retriever_and_scores_the_answer(tok, tmp_path):
    retriever = Retriever(["Paris is the capital of France", "Berlin is in Germany", "The Loire is long"])
    try:
        rows = [
            {
                "prompt": [{"role": "user", "content": "Capital of France?"}],
                "env_class": "search",
                "reward_spec": {"method": "rule", "ground_truth": {"target": ["Paris"]}},
                "extra_info": {"index": 0},
            }
        ] * 2
        data = write_rows(tmp_path / "search.parquet", rows)
        settings = gym(
            f"environment.skyrl_gym.search.search_url={retriever.url}", "environment.skyrl_gym.search.topk=2"
        )
        task = DataTask(tok, [data], [data], skyrl_gym=settings)
        # the start-up probe
        assert retriever.queries == [{"query": "probe", "topk": 2, "return_scores": False}]
        turns = ["<search>capital of France</search>", "<answer>Paris</answer>"]
        traj, client = play(task, tok, turns, stop=["</search>", "</answer>"], max_turns=2)
        assert retriever.queries[-1] == {"query": "capital of France", "topk": 2, "return_scores": True}
        seen = tok.decode(client.prompts[1])
        assert "<information>" in seen and "Doc 1: Paris is the capital of France" in seen
        assert "Doc 2:" in seen and "Doc 3:" not in seen  # topk=2 reached the retriever
        assert traj.num_turns == 2 and traj.reward == 1.0 and traj.finish_reason == "stop"
    finally:
        retriever.close()


def test_aime_scores_with_verl_style_reward_model_rows(tok, tmp_path):
    rows = [
        {
            "data_source": "aime",
            "prompt": [{"role": "user", "content": f"Problem {i}"}],
            "ability": "MATH",
            "reward_model": {"ground_truth": "540", "style": "rule-lighteval/MATH_v2"},
            "extra_info": {"index": i},
        }
        for i in range(3)
    ]
    data = write_rows(tmp_path / "aime.parquet", rows)
    task = DataTask(tok, [data], [data], env_class="aime")
    problem = task.train_problems()[0]
    assert problem.answer == "540" and task.report.rewards == {"aime": 6}
    assert asyncio.run(task.score(problem, "so Answer: 540")) == 1.0
    assert asyncio.run(task.score(problem, "so Answer: 541")) == -1.0  # skyrl-gym's aime scores -1
    traj, _ = play(task, tok, ["work... Answer: 540"])
    assert traj.reward == 1.0 and traj.info["acc"] is True and traj.info["pred"] == "540"


JUDGE_MODULE = textwrap.dedent('''
    import skyrl_gym
    from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput

    class JudgeEnv(BaseTextEnv):
        def __init__(self, env_config, extras):
            super().__init__()
            self.model, self.base_url = env_config.model, env_config.base_url
            self.truth = extras["reward_spec"]["ground_truth"]

        def step(self, action):
            return BaseTextEnvStepOutput(observations=[], reward=float(self.truth in action), done=True,
                                         metadata={"judge": self.model, "judge_url": self.base_url})

    skyrl_gym.register(id="llm_as_a_judge", entry_point="inflight_test_judge:JudgeEnv")
''')


def test_your_own_env_class_gets_the_section_of_the_id_it_registers(tok, tmp_path, monkeypatch):
    (tmp_path / "inflight_test_judge.py").write_text(JUDGE_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    ours = skyrl_gym.registry.pop("llm_as_a_judge", None)  # the built-in one, once a run registered it
    data = write_rows(tmp_path / "d.parquet", [{"prompt": "say 7", "answer": "7"}] * 2)
    settings = gym("environment.skyrl_gym.llm_as_a_judge.model=tiny-judge")
    task = DataTask(tok, [data], [data], env_class="inflight_test_judge:JudgeEnv", skyrl_gym=settings)
    traj, _ = play(task, tok, ["it is 7"])
    assert traj.reward == 1.0 and traj.info["judge"] == "tiny-judge" and traj.info["judge_url"] is None
    skyrl_gym.registry.pop("llm_as_a_judge")
    sys.modules.pop("inflight_test_judge")
    if ours is not None:
        skyrl_gym.registry["llm_as_a_judge"] = ours


class SlowEnv(skyrl_gym.Env):
    """Records how many of its steps run at once."""

    lock, active, peak = threading.Lock(), 0, 0

    def __init__(self, env_config=None, extras=None):
        self.turns = 0

    def init(self, prompt):
        return prompt, {}

    def step(self, action):
        with SlowEnv.lock:
            SlowEnv.active += 1
            SlowEnv.peak = max(SlowEnv.peak, SlowEnv.active)
        time.sleep(0.02)  # long enough for the others to arrive
        with SlowEnv.lock:
            SlowEnv.active -= 1
        return {"observations": [], "reward": 1.0, "done": True, "metadata": {}}


def test_max_env_workers_bounds_the_steps_that_run_at_once(tok, tmp_path):
    skyrl_gym.register(id="inflight_test_slow", entry_point=SlowEnv)
    try:
        data = write_rows(tmp_path / "d.parquet", [{"prompt": "hi", "answer": "x"}] * 2)
        settings = gym("environment.skyrl_gym.max_env_workers=2")
        task = DataTask(tok, [data], [data], env_class="skyrl_gym:inflight_test_slow", skyrl_gym=settings)
        eos = tok.eos_token_id
        client = ScriptedClient([(encode(tok, "ok") + [eos], "stop")] * 8)
        group = asyncio.run(TaskGenerator(client, task, n=8, max_tokens=8)(task.train_problems()[0]))
        assert group.rewards == [1.0] * 8 and SlowEnv.peak == 2
    finally:
        skyrl_gym.registry.pop("inflight_test_slow")


GSM8K_RESPONSES = [
    ("Natalia sold 48 + 24 = 72 clips.\n#### 72", "72"),
    ("#### 72", "72"), ("#### 71", "72"), ("#### -5", "-5"), ("#### 1,000", "1000"),
    ("The answer is 72.", "72"), ("no number at all", "3"), ("#### 7.5", "7.5"),
    ("first 3 then\n#### 18", "18"), ("#### 0", "0"),
]
DIFFERENT = [  # ours compares numbers and reads the last `####`; GSM8kEnv compares strings, reads the first
    ("#### $1,000", "1000"), ("#### 72.0", "72"), ("#### 5 no wait #### 6", "6"), ("####72", "72"),
]


def gsm8k_env_reward(response: str, truth: str) -> float:
    env = skyrl_gym.make("gsm8k", env_config={}, extras={"reward_spec": {"ground_truth": truth}})
    return float(env.step(response)["reward"])


def test_our_gsm8k_against_skyrl_gyms_gsm8k_env():
    ours = get_reward("gsm8k")
    for response, truth in GSM8K_RESPONSES:
        assert ours(response, truth) == gsm8k_env_reward(response, truth), response
    for response, truth in DIFFERENT:  # the documented differences: ours scores these 1, SkyRL's 0
        assert (ours(response, truth), gsm8k_env_reward(response, truth)) == (1.0, 0.0), response


def test_lcb_runs_the_code_it_scores_in_local_processes(tok, tmp_path):
    tests = json.dumps([{"input": "3\n", "output": "6\n", "testtype": "stdin"},
                        {"input": "5\n", "output": "10\n", "testtype": "stdin"}])
    rows = [{"prompt": "Print twice the number read.", "env_class": "lcb",
             "reward_spec": {"method": "rule", "ground_truth": tests}, "extra_info": {"index": 0}}] * 2
    data = write_rows(tmp_path / "lcb.parquet", rows)
    task = DataTask(tok, [data], [data])
    problem = task.train_problems()[0]
    assert asyncio.run(task.score(problem, "```python\nn = int(input())\nprint(2 * n)\n```")) == 1.0
    assert asyncio.run(task.score(problem, "```python\nprint(input())\n```")) == 0.0
