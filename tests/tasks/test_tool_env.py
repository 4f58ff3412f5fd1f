"""ToolEnv: Hermes-format calls run registered Python functions; failures are tool messages; the
final answer is scored by the reward named for the row; `env_class: tool` finds it."""

from __future__ import annotations

import asyncio

import pytest
from transformers.utils import get_json_schema

from inflight.rewards import environment_class
from inflight.tasks.base import Problem
from inflight.tasks.tool_env import ToolEnv, calculator, make_tool, register_tool, tool_names


def call(name: str, **arguments) -> str:
    import json

    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def step(env: ToolEnv, text: str):
    return asyncio.run(env.step(text))


def problem(answer: str = "42", **extra) -> Problem:
    return Problem("p", "question", answer, {"extra_info": extra})


def test_calculator_agrees_with_python_arithmetic():
    for expr in ("(3 + 4) * 12", "7 / 2", "2 ** 10", "-5 // 2", "17 % 5", "1.5 * 4", "10 - 2 - 3"):
        want = eval(expr)  # the reference: Python's own arithmetic on these literals
        assert float(calculator(expr)) == pytest.approx(want)
    assert calculator("6 / 3") == "2"
    for bad in ("__import__('os')", "a + 1", "9 ** 9 ** 9", "1 +"):
        with pytest.raises(ValueError):
            calculator(bad)


def test_schema_comes_from_transformers_and_the_registry_holds_calculator():
    assert "calculator" in tool_names()
    tool = make_tool(calculator)
    assert tool.schema == get_json_schema(calculator)
    env = ToolEnv(problem(), tools=["calculator"])
    assert env.tools == [tool.schema] and env.max_turns is None


def test_calls_results_and_errors():
    async def slow_upper(text: str) -> str:
        """Upper-case text.

        Args:
            text: The text.
        """
        await asyncio.sleep(0)
        return text.upper()

    def broken(x: int) -> int:
        """Always fails.

        Args:
            x: Anything.
        """
        raise RuntimeError("no")

    env = ToolEnv(problem(), tools=[calculator, slow_upper, broken], reward="exact")
    env.reset()
    out = step(env, "thinking\n" + call("calculator", expression="6*7") + call("slow_upper", text="ab"))
    assert not out.done and out.reward == 0.0
    assert out.observation == [{"role": "tool", "name": "calculator", "content": "42"},
                               {"role": "tool", "name": "slow_upper", "content": "AB"}]
    texts = [step(env, t).observation[0]["content"] for t in (
        call("nope"), call("calculator", expr="1"), call("broken", x=1), "<tool_call>{oops}</tool_call>")]
    assert texts[0].startswith("Error: unknown tool 'nope'; the tools are: calculator, slow_upper, broken")
    assert texts[1].startswith("Error: bad arguments for 'calculator'")
    assert texts[2] == "Error: 'broken' raised RuntimeError: no"
    assert texts[3].startswith("Error: the tool call is not valid")
    final = step(env, " 42 ")
    assert final.done and final.reward == 1.0 and final.info == {"tool_calls": 5, "tool_errors": 4,
                                                                  "correct": True}


def test_a_call_cut_at_its_stop_string_is_closed():
    env = ToolEnv(problem(), tools=["calculator"])
    text = call("calculator", expression="1+1")
    out = step(env, text[: -len("</tool_call>")])
    assert out.observation == [{"role": "tool", "name": "calculator", "content": "2"}]


def test_the_rows_extra_info_picks_tools_reward_and_turns():
    register_tool(lambda: "pong", name="ping", schema={"name": "ping", "description": "Ping.",
                                                       "parameters": {"type": "object", "properties": {}}})
    env = ToolEnv(problem("7", tools=["ping"], reward="contains", max_turns=3, pattern=None))
    assert [t["function"]["name"] for t in env.tools] == ["ping"] and env.max_turns == 3
    assert step(env, call("ping")).observation[0]["content"] == "pong"
    assert step(env, "the answer is 7").reward == 1.0  # contains
    gsm = Problem("g", "q", "72", {"gsm8k_format": True, "extra_info": {}})
    assert step(ToolEnv(gsm, tools=[]), "so #### 72").reward == 1.0  # GSM8K's rule for GSM8K rows
    assert step(ToolEnv(problem("72"), tools=[]), "so #### 72").reward == 0.0  # exact otherwise
    with pytest.raises(ValueError, match="unknown tool 'nope'"):
        ToolEnv(problem(tools=["nope"]))


def test_env_class_tool_is_found_by_the_reward_registry():
    assert environment_class("tool") is ToolEnv
    assert environment_class("inflight.tasks.tool_env:ToolEnv") is ToolEnv
