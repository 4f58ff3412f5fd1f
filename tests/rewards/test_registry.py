"""Rewards by name: text rules, register, user `module:name` (function or environment class), score."""

from __future__ import annotations

import asyncio
import sys
import textwrap

import pytest

from inflight.rewards import RewardError, environment_class, get_reward, register, reward_names, score
from inflight.testing import LOCAL_CPU


def test_text_rules():
    assert get_reward("exact")("  54 \n", "54") == 1.0
    assert get_reward("exact")("#### 54", "54") == 0.0
    assert get_reward("contains")("so it is 54 apples", "54") == 1.0
    assert get_reward("contains")("so it is 5", "54") == 0.0
    assert get_reward("regex")("Final: B", r"Final:\s*[AB]$") == 1.0
    assert get_reward("regex")("Final: C", r"Final:\s*[AB]$") == 0.0
    assert get_reward("regex")("the cat", "unused", pattern=r"\bcat\b") == 1.0
    with pytest.raises(RewardError, match="not a valid regular expression"):
        get_reward("regex")("x", "(")


def test_unknown_name_suggests_and_names_the_key():
    with pytest.raises(RewardError, match=r"environment.env_class='gsm8kk'.*did you mean 'gsm8k'"):
        get_reward("gsm8kk")
    assert {"gsm8k", "gsm8k_flexible", "math", "exact", "contains", "regex"} <= set(reward_names())


def test_register_and_score_sync_and_async():
    register("test_len", lambda response, ground_truth, **_: float(len(response) == int(ground_truth)))

    async def slow(response, ground_truth, **extra):
        await asyncio.sleep(0)
        return response == ground_truth + extra.get("suffix", "")

    register("test_async", slow)
    assert get_reward("test_len")("abc", "3") == 1.0
    assert asyncio.run(score("test_len", "ab", "3")) == 0.0
    assert asyncio.run(score("test_async", "ab!", "ab", suffix="!")) == 1.0
    assert asyncio.run(score(get_reward("gsm8k"), "#### 3", "3")) == 1.0
    with pytest.raises(RewardError, match="built-in"):
        register("gsm8k", lambda r, g: 0.0)
    register("test_text", lambda r, g: "yes")
    with pytest.raises(RewardError, match="not a number"):
        asyncio.run(score("test_text", "a", "b"))


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    name = "user_rewards_for_test"
    (tmp_path / f"{name}.py").write_text(
        textwrap.dedent("""
        from inflight.tasks.base import Environment, StepResult

        def first_word(response, ground_truth, **extra):
            words = response.split()
            return float(bool(words) and words[0] == ground_truth)

        class EchoEnv(Environment):
            def __init__(self, problem):
                self.problem = problem
            def reset(self):
                return self.problem.prompt
            def step(self, response):
                return StepResult(None, float(self.problem.answer in response), True)

        NOT_CALLABLE = 3
    """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)


def test_user_function_and_environment_class(user_module):
    assert get_reward(f"{user_module}:first_word")("yes it is", "yes") == 1.0
    assert environment_class(f"{user_module}:first_word") is None
    env = environment_class(f"{user_module}:EchoEnv")
    assert env is not None and env.__name__ == "EchoEnv"
    from inflight.tasks import environment_reward

    assert environment_reward(f"{user_module}:EchoEnv")("it is 42", "42") == 1.0  # its single-turn score
    with pytest.raises(RewardError, match=r"environment class, not a reward function"):
        get_reward(f"{user_module}:EchoEnv")
    with pytest.raises(RewardError, match="has no attribute 'nope'"):
        get_reward(f"{user_module}:nope")
    with pytest.raises(RewardError, match="not a reward function"):
        get_reward(f"{user_module}:NOT_CALLABLE")


def test_import_error_names_the_module_and_the_key():
    with pytest.raises(
        RewardError,
        match=r"environment.env_class='no_such_pkg.mod:f'.*cannot import module "
        r"'no_such_pkg.mod'",
    ):
        get_reward("no_such_pkg.mod:f")


def test_the_built_in_tool_environment_is_a_known_env_class_before_its_module_is_imported():
    """`environment.env_class=tool` validates although inflight.tasks (which defines it) sits above
    the rewards package and may not be imported yet."""
    from inflight.config import load_config
    from inflight.rewards import environment_class, reward_names
    from inflight.tasks.tool_env import ToolEnv

    assert "tool" in reward_names()
    assert load_config(None, [*LOCAL_CPU, "environment.env_class=tool"]).environment.env_class == "tool"
    assert environment_class("tool") is ToolEnv
