"""Tool calls in model output, in the Hermes format that Qwen2.5/Qwen3 chat templates teach:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

`parse_tool_calls(text)` splits a response into its plain content and its calls. A block whose body
is not a JSON object with a string `name` (and an object `arguments`, default `{}`) is not a call:
it stays in the content, as vLLM's hermes parser leaves it, so nothing the model wrote is lost. An
opening tag with no closing tag (a truncated response) is content too.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(TOOL_CALL_OPEN) + r"(.*?)" + re.escape(TOOL_CALL_CLOSE), re.S)


@dataclass(frozen=True)
class ToolCall:
    """One call: the function's name and its arguments (a JSON object)."""

    name: str
    arguments: dict[str, Any]
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}", compare=False)

    def to_openai(self) -> dict[str, Any]:
        """The OpenAI `tool_calls` entry (`arguments` as a JSON string, as the API sends it)."""
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": json.dumps(self.arguments)}}  # fmt: skip

    def to_message(self) -> dict[str, Any]:
        """The entry of an assistant message's `tool_calls` as chat templates read it."""
        return {"type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def _call(body: str) -> ToolCall | None:
    try:
        value = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(value["name"], arguments)


def parse_tool_calls(text: str) -> tuple[str, list[ToolCall]]:
    """(content, calls): `text` without its well-formed tool-call blocks, and those calls in order.
    The content is stripped of the white space the blocks leave around them."""
    calls: list[ToolCall] = []
    pieces: list[str] = []
    last = 0
    for match in _BLOCK.finditer(text):
        call = _call(match.group(1).strip())
        if call is None:
            continue
        pieces.append(text[last : match.start()])
        calls.append(call)
        last = match.end()
    pieces.append(text[last:])
    return ("".join(pieces).strip() if calls else text), calls


def has_open_tool_call(text: str) -> bool:
    """Whether `text` ends inside a tool-call block (streaming: hold the text back until it closes)."""
    return text.rfind(TOOL_CALL_OPEN) > text.rfind(TOOL_CALL_CLOSE)
