"""What skyrl-gym's environments need is checked when the data loads, before any training: a missing
database, retriever or judge server, a row without the columns its environment reads, an id skyrl-gym
does not hold, each fails naming the key (or the row) and what to do. And the run's config reaches
them: `environment.env_class` names accepted by validation, `make_data_task` passing the sections."""

from __future__ import annotations

import pytest
import skyrl_gym
from gym_support import closed_port_url, make_spider_db, write_rows

from inflight.config import load_config
from inflight.config.job import JobConfig
from inflight.config.validate import env_class_problem
from inflight.rewards import RewardError
from inflight.rewards.hubs import find_hub
from inflight.rewards.registry import skyrl_gym_id
from inflight.tasks import DataTask
from inflight.tasks.dataset import DatasetError
from inflight.tasks.skyrl_gym_env import GymSettings
from inflight.tasks.skyrl_gym_services import SkyRLGymServiceError
from inflight.testing import LOCAL_CPU
from inflight.testing.tiny_model import make_tokenizer
from inflight.train.data_setup import make_data_task

TOK = make_tokenizer()


def gym(*overrides: str) -> GymSettings:
    return GymSettings(load_config(None, [*LOCAL_CPU, *overrides]).environment.skyrl_gym, 2)


def sql_rows(db_id: str, data: str = "spider") -> list[dict]:
    return [{"prompt": [{"role": "user", "content": "q"}], "env_class": "text2sql",
             "reward_spec": {"method": "rule", "ground_truth": "SELECT 1"}, "db_id": db_id, "data": data,
             "extra_info": {"index": 0}}] * 2


def load(tmp_path, rows, env_class=None, settings=None):
    data = write_rows(tmp_path / "rows.parquet", rows)
    return DataTask(TOK, [data], [data], env_class=env_class, skyrl_gym=settings or gym())


def test_text2sql_needs_its_databases(tmp_path):
    with pytest.raises(
        SkyRLGymServiceError,
        match=r"environment.skyrl_gym.text2sql.db_path='/home/ray/default/"
        r"sql_data' is not a directory",
    ):
        load(tmp_path, sql_rows("concert"))  # SkyRL's default path
    root = make_spider_db(tmp_path / "sql")
    settings = gym(f"environment.skyrl_gym.text2sql.db_path={root}")
    assert load(tmp_path, sql_rows("concert"), settings=settings).report.rewards == {"text2sql": 4}
    with pytest.raises(
        DatasetError,
        match=r"rows.parquet:1: the skyrl-gym environment 'text2sql' cannot be built "
        r"for this row \(FileNotFoundError: .*missing.sqlite\); "
        r"environment.skyrl_gym.text2sql.db_path=.* must hold the database the "
        r"row names \(db_id='missing', data='spider'\)",
    ):
        load(tmp_path, sql_rows("missing"), settings=settings)
    with pytest.raises(DatasetError, match=r"its 'data' column \('wikisql'\) names no data set"):
        load(tmp_path, sql_rows("concert", data="wikisql"), settings=settings)


def test_search_needs_a_retriever_that_answers(tmp_path):
    rows = [{"prompt": "q", "env_class": "search", "reward_spec": {"ground_truth": {"target": ["x"]}}}] * 2
    url = closed_port_url()
    with pytest.raises(
        SkyRLGymServiceError,
        match=rf"environment.skyrl_gym.search.search_url='{url}': the search "
        r"environment needs a retrieval service there and none answered",
    ):
        load(tmp_path, rows, settings=gym(f"environment.skyrl_gym.search.search_url={url}"))


def test_searchcode_needs_the_retriever_at_skyrl_gyms_fixed_url(tmp_path):
    rows = [{"prompt": "q", "env_class": "searchcode", "reward_spec": {"ground_truth": "1"}}] * 2
    with pytest.raises(
        SkyRLGymServiceError,
        match=r"searchcode environment searches 'http://127.0.0.1:8000/retrieve' "
        r"\(a fixed URL: it reads no environment.skyrl_gym.search key\)",
    ):
        load(tmp_path, rows)


class Judge(skyrl_gym.Env):
    def __init__(self, env_config=None, extras=None):
        self.base_url = env_config.base_url

    def init(self, prompt):
        return prompt, {}


def test_a_judge_server_must_answer_at_its_base_url(tmp_path):
    # a run earlier in the session may have registered ours (tasks/skyrl_examples.py): set it aside
    previous = skyrl_gym.registry.pop("llm_as_a_judge", None)
    skyrl_gym.register(id="llm_as_a_judge", entry_point=Judge)
    try:
        url = closed_port_url("/v1")
        with pytest.raises(
            SkyRLGymServiceError,
            match=rf"environment.skyrl_gym.llm_as_a_judge.base_url='{url}': "
            r"the judge's OpenAI-compatible server does not answer",
        ):
            load(tmp_path, [{"prompt": "q", "answer": "1"}] * 2, env_class="skyrl_gym:llm_as_a_judge",
                 settings=gym(f"environment.skyrl_gym.llm_as_a_judge.base_url={url}"))
        # registered: its bare name too, as in SkyRL's example
        assert find_hub("llm_as_a_judge").name == "skyrl-gym"
        task = load(tmp_path, [{"prompt": "q", "answer": "1"}] * 2, env_class="llm_as_a_judge")
        assert task.make_env(task.train_problems()[0]).env.base_url is None  # null: OpenAI's, not probed
    finally:
        skyrl_gym.registry.pop("llm_as_a_judge")
        if previous is not None:
            skyrl_gym.registry["llm_as_a_judge"] = previous
    assert find_hub("llm_as_a_judge").name == "skyrl-gym"  # SkyRL's example id: ours registers it when built


def test_rows_without_what_their_environment_reads_are_named(tmp_path):
    # aime reads reward_model
    rows = [{"prompt": "q", "env_class": "aime", "reward_spec": {"ground_truth": "5"}}] * 2
    with pytest.raises(
        DatasetError,
        match=r"rows.parquet:1: the skyrl-gym environment 'aime' cannot be built for "
        r"this row \(AssertionError: reward_model field is required\)",
    ):
        load(tmp_path, rows)


def test_unknown_ids_and_names(tmp_path):
    with pytest.raises(
        RewardError,
        match=r"'skyrl_gym:nope': skyrl-gym has no environment 'nope' \(it holds aime, "
        r"gsm8k, gsm8k_multi_turn, .*lcb, .*search, searchcode, text2sql",
    ):
        load(tmp_path, [{"prompt": "q", "answer": "1"}] * 2, env_class="skyrl_gym:nope")
    # ours wins the bare name
    assert skyrl_gym_id("gsm8k") is None and skyrl_gym_id("skyrl_gym:gsm8k") == "gsm8k"
    assert skyrl_gym_id("text2sql") == "text2sql" and skyrl_gym_id("skyrl_gym:") is None
    for name in ("aime", "gsm8k_multi_turn", "lcb", "search", "searchcode", "text2sql", "skyrl_gym:anything",
                 "gsm8k", "tool"):
        assert find_hub(name).name == ("ours" if name in ("gsm8k", "tool") else "skyrl-gym")
        assert load_config(None, [*LOCAL_CPU, f"environment.env_class={name}"]).environment.env_class == name
    assert "did you mean 'text2sql'" in env_class_problem("text2sq").fix
    with pytest.raises(RewardError, match=r"environment.env_class='skyrl_gym:': write 'package.module:name'"):
        load(tmp_path, [{"prompt": "q", "answer": "1"}] * 2, env_class="skyrl_gym:")


def test_make_data_task_passes_the_run_config(tmp_path, tiny_model_factory):
    root = make_spider_db(tmp_path / "sql")
    data = write_rows(tmp_path / "rows.parquet", sql_rows("concert"))
    cfg = load_config(
        None,
        [
            *LOCAL_CPU,
            f"trainer.policy.model.path={tiny_model_factory('qwen2')}",
            f"data.train_data=[{data}]",
            f"data.val_data=[{data}]",
            "generator.max_turns=3",
            "environment.env_class=text2sql",
            f"environment.skyrl_gym.text2sql.db_path={root}",
            "environment.skyrl_gym.max_env_workers=3",
            "generator.chat_template.name_or_path=qwen3_with_thinking",
            "generator.chat_template_kwargs={enable_thinking: false}",
        ],
    )
    task = make_data_task(cfg, JobConfig())
    assert task.skyrl_gym.sections is cfg.environment.skyrl_gym and task.skyrl_gym.calls.workers == 3
    maker = task.reward_fn(task.train_problems()[0])
    assert maker.extras(task.train_problems()[0])["max_turns"] == 3
    env = task.make_env(task.train_problems()[0]).env
    assert env.db_path == f"{root}/spider/database" and env.max_turns == 3
    assert (
        task.chat_format.kwargs == {"enable_thinking": False} and "<|im_start|>" in task.chat_format.template
    )
    assert task.decode(task.encode_prompt(task.train_problems()[0].prompt)).endswith("</think>\n\n")
