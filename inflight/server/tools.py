"""Tools on `/v1/chat/completions`: the request side (which tools, whether calls are parsed) and the
messages of earlier turns (assistant `tool_calls`, `tool` results) in the form chat templates read.

- `tools` go into the chat template exactly as sent (`apply_chat_template(..., tools=...)`); a
  template that renders nothing for them is refused, so tools are never silently dropped.
- `tool_choice`: `"auto"` (the default when tools are given) parses Hermes-format calls out of the
  output; `"none"` still renders the tools (the model may talk about them, as vLLM >= 0.10 and
  OpenAI do) but parses nothing. `"required"` and a named function need constrained decoding,
  which the engine does not have: refused with a 400 naming `tool_choice`.
- An assistant message's `tool_calls[].function.arguments` arrive as a JSON string (the OpenAI
  client's form); Qwen/Hermes templates render them with `tojson`, so they are parsed to objects.
- Calls are read from the decoded text, so the tags must survive decoding: they do in Qwen2.5/Qwen3
  tokenizers (`<tool_call>` is an added, non-special token); where a tokenizer marks them special,
  send `skip_special_tokens: false`.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import ValidationError

from inflight.server.errors import APIError
from inflight.server.protocol import ChatCompletionRequest, ToolDefinition


def _bad(message: str, param: str, code: str = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


def parses_tool_calls(req: ChatCompletionRequest) -> bool:
    """Validate `tools` / `tool_choice`; True when calls in the output are to be parsed."""
    for i, tool in enumerate(req.tools or []):
        try:
            ToolDefinition.model_validate(tool)
        except ValidationError as err:
            first = err.errors()[0]
            where = ".".join(str(x) for x in first["loc"])
            raise _bad(f"tools[{i}] is not a function tool ({where}: {first['msg']}); expected "
                       '{"type": "function", "function": {"name": ..., "parameters": {...}}}',
                       f"tools[{i}].{where}" if where else f"tools[{i}]") from err
    choice = req.tool_choice
    if choice is None or choice in ("auto", "none"):
        return bool(req.tools) and choice != "none"
    if choice == "required" or isinstance(choice, dict):
        raise _bad(f"tool_choice={choice!r} is not supported: forcing a call needs constrained decoding, "
                   "which this server does not have; use 'auto' (the model decides) or 'none'",
                   "tool_choice", "unsupported_parameter")
    raise _bad(f"tool_choice={choice!r} must be 'auto' or 'none'", "tool_choice")


def _arguments(value: Any, param: str) -> dict[str, Any]:
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else {}
        except json.JSONDecodeError as err:
            raise _bad(f"{param} is not valid JSON: {err}", param) from err
    if not isinstance(value, dict):
        raise _bad(f"{param} must be a JSON object (as a string or an object)", param)
    return value


def template_tool_calls(calls: Any, param: str) -> list[dict[str, Any]]:
    """An assistant message's OpenAI `tool_calls` with each `arguments` as an object."""
    if not isinstance(calls, list):
        raise _bad(f"{param} must be a list", param)
    out = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise _bad(
                f'{param}[{j}] must be {{"type": "function", "function": {{"name": ..., "arguments": ...}}}}',
                f"{param}[{j}]",
            )
        arguments = _arguments(function.get("arguments", {}), f"{param}[{j}].function.arguments")
        out.append({**call, "function": {**function, "arguments": arguments}})
    return out


__all__ = ["parses_tool_calls", "template_tool_calls"]
