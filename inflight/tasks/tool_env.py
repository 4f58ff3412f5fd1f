"""The built-in tool environment (`env_class: tool`): the model calls registered Python functions.

The model writes Hermes-format calls (the format Qwen2.5/Qwen3 templates teach), parsed by
`inflight.chat.tool_calls`:

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "17 * 23"}}
    </tool_call>

Each call runs the registered function and its result comes back as a `tool` message (the chat
template renders it, e.g. as Qwen's `<tool_response>`); an unknown tool, arguments that do not fit
the function, a function that raises, or a `<tool_call>` block that is not valid JSON all come back
as an `Error: ...` tool message, and the episode goes on. Synchronous tools run in their own
thread; one that hangs is bounded by `environment.reward_timeout_s` on the whole step (the sample
then scores 0 and is counted as a reward failure). A turn without a tool call is the final
answer: it is scored by the reward (and ends the episode). Running out of turns before a final
answer scores 0. A response that ends inside a `<tool_call>` block (cut at the stop string
`</tool_call>`, which the text drops unless `include_stop_str_in_output`) is closed before parsing.

Tools: `register_tool(fn)` adds one to the registry (its JSON schema from the type hints and the
Google-style docstring, by `transformers.utils.get_json_schema`, or given as `schema=`); the
built-in `calculator` evaluates arithmetic. `ToolEnv(problem, tools=..., reward=..., max_turns=...)`
offers `tools` (names or functions; default: the row's `extra_info["tools"]`, else every registered
tool), scores the final answer with `reward` (a reward name or function; default: the row's
`extra_info["reward"]`, else `gsm8k` for GSM8K-style answers and `exact` otherwise), and plays at
most `max_turns` turns (default: `extra_info["max_turns"]`, else the run's `generator.max_turns`).
The tools' schemas go to the chat template with the prompt, so the system prompt lists them.
"""

from __future__ import annotations

import ast
import inspect
import json
import math
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from inflight.chat.tool_calls import (
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    ToolCall,
    has_open_tool_call,
    parse_tool_calls,
)
from inflight.rewards import register, score
from inflight.tasks.base import Environment, Problem, StepResult, in_thread

ENV_CLASS = "tool"
OWN_KEYS = ("tools", "reward", "max_turns")
"""`extra_info` keys that configure the environment (not passed to the reward)."""


@dataclass(frozen=True)
class Tool:
    """A function the model may call, with the JSON schema the chat template shows it."""

    name: str
    fn: Callable[..., Any]
    schema: dict[str, Any]
    """OpenAI's `{"type": "function", "function": {"name", "description", "parameters"}}`."""


_TOOLS: dict[str, Tool] = {}


def make_tool(fn: Callable[..., Any], name: str | None = None, schema: dict[str, Any] | None = None) -> Tool:
    """`fn` as a tool named `name` (default: its `__name__`), described by `schema` (default: from its
    type hints and docstring)."""
    name = name or getattr(fn, "__name__", None)
    if not name or not callable(fn):
        raise TypeError(f"a tool needs a callable and a name, got {fn!r}")
    if schema is None:
        from transformers.utils import get_json_schema

        try:
            schema = get_json_schema(fn)
        except Exception as err:
            raise ValueError(f"tool {name!r}: cannot describe {fn!r} for the chat template ({err}); give it "
                             "type hints and a Google-style docstring with an Args: section, or pass "
                             "schema=") from err
    function = dict(schema.get("function", schema))
    function["name"] = name
    return Tool(name, fn, {"type": "function", "function": function})


def register_tool(
    fn: Callable[..., Any], name: str | None = None, schema: dict[str, Any] | None = None
) -> Tool:
    """Add `fn` to the registry every `ToolEnv` can offer (replacing a tool of the same name)."""
    tool = make_tool(fn, name, schema)
    _TOOLS[tool.name] = tool
    return tool


def tool_names() -> list[str]:
    """The registered tools' names."""
    return list(_TOOLS)


def resolve_tools(tools: Sequence[str | Callable[..., Any] | Tool] | None) -> dict[str, Tool]:
    """Tools by name: registered names, functions or `Tool`s; None: every registered tool."""
    if tools is None:
        return dict(_TOOLS)
    out: dict[str, Tool] = {}
    for t in tools:
        if isinstance(t, str):
            if t not in _TOOLS:
                raise ValueError(f"unknown tool {t!r}; registered: {', '.join(_TOOLS) or 'none'} "
                                 "(add one with inflight.tasks.tool_env.register_tool)")
            tool = _TOOLS[t]
        else:
            tool = t if isinstance(t, Tool) else make_tool(t)
        out[tool.name] = tool
    return out


def default_reward(problem: Problem) -> str:
    """The row's `extra_info["reward"]`, else `gsm8k` for GSM8K-style answers, else `exact`."""
    extra = problem.meta.get("extra_info") or {}
    if extra.get("reward"):
        return str(extra["reward"])
    return "gsm8k" if problem.meta.get("gsm8k_format") else "exact"


class ToolEnv(Environment):
    """Tool calls answered by Python functions until a final answer, which `reward` scores."""

    def __init__(
        self,
        problem: Problem,
        tools: Sequence[str | Callable[..., Any] | Tool] | None = None,
        reward: str | Callable[..., Any] | None = None,
        max_turns: int | None = None,
    ) -> None:
        self.problem = problem
        extra = dict(problem.meta.get("extra_info") or {})
        self._tools = resolve_tools(tools if tools is not None else extra.get("tools"))
        self.tools = [t.schema for t in self._tools.values()] or None
        self.reward = reward if reward is not None else default_reward(problem)
        self.max_turns = max_turns if max_turns is not None else extra.get("max_turns")
        self.extra = {k: v for k, v in extra.items() if k not in (*OWN_KEYS, "response", "ground_truth")}
        self.calls = self.errors = 0

    def reset(self) -> str | list[dict[str, Any]]:
        self.calls = self.errors = 0
        return self.problem.prompt

    async def step(self, response: str) -> StepResult:
        if has_open_tool_call(response):  # cut by the stop string `</tool_call>`, dropped from the text
            response += TOOL_CALL_CLOSE
        content, calls = parse_tool_calls(response)
        if not calls and TOOL_CALL_OPEN in response:
            self.errors += 1
            error = ('Error: the tool call is not valid: write <tool_call>{"name": <tool name>, "arguments": '
                     "{...}}</tool_call> with a JSON object inside")
            return StepResult([{"role": "tool", "content": error}], 0.0, False, self.info())
        if not calls:
            value = await score(self.reward, content, self.problem.answer, **self.extra)
            return StepResult(None, value, True, {**self.info(), "correct": value >= 1.0})
        results = [await self.call(c) for c in calls]
        messages = [{"role": "tool", "name": c.name, "content": r}
                    for c, r in zip(calls, results, strict=True)]
        return StepResult(messages, 0.0, False, self.info())

    async def call(self, call: ToolCall) -> str:
        """The tool's result as text, or an `Error: ...` text (counted) when the call fails."""
        self.calls += 1
        tool = self._tools.get(call.name)
        if tool is None:
            known = ", ".join(self._tools) or "none"
            return self._error(f"unknown tool {call.name!r}; the tools are: {known}")
        try:
            inspect.signature(tool.fn).bind(**call.arguments)
        except TypeError as err:
            return self._error(f"bad arguments for {call.name!r}: {err}")
        try:  # a sync tool runs in its own thread: one that hangs cannot block the event loop
            if inspect.iscoroutinefunction(tool.fn):
                value = await tool.fn(**call.arguments)
            else:
                value = await in_thread(tool.fn, **call.arguments)
            if inspect.isawaitable(value):
                value = await value
        except Exception as err:
            return self._error(f"{call.name!r} raised {type(err).__name__}: {err}")
        return value if isinstance(value, str) else json.dumps(value, default=str)

    def _error(self, text: str) -> str:
        self.errors += 1
        return "Error: " + text

    def info(self) -> dict[str, Any]:
        return {"tool_calls": self.calls, "tool_errors": self.errors}


# ---- the built-in tool --------------------------------------------------------------------------
_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
}
_UNARY: dict[type, Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_BITS = 4096
"""Largest result (in bits) the calculator computes: `9**9**9` is refused, not computed."""


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) * math.log2(abs(left) + 2) > MAX_BITS:
            raise ValueError("the power is too large")
        return _BINARY[type(node.op)](left, right)
    raise ValueError(f"only numbers and + - * / // % ** ( ) are allowed, not {ast.unparse(node)!r}")


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: Numbers with + - * / // % ** and parentheses, e.g. "(3 + 4) * 12".
    """
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as err:
        raise ValueError(f"not an arithmetic expression: {expression!r}") from err
    value = _evaluate(tree.body)
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        value = int(value)
    return format(value, ".12g") if isinstance(value, float) else str(value)


register_tool(calculator)
register(ENV_CLASS, ToolEnv)
