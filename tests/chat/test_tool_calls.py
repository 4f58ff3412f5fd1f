"""Hermes-format tool calls: well-formed blocks become calls, anything else stays content."""

from __future__ import annotations

import json

from inflight.chat.tool_calls import ToolCall, has_open_tool_call, parse_tool_calls


def test_calls_are_split_from_the_content_in_order():
    text = ('Let me check.\n<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}</tool_call>')
    content, calls = parse_tool_calls(text)
    assert content == "Let me check."
    assert calls == [ToolCall("weather", {"city": "Paris"}), ToolCall("add", {"a": 1, "b": 2})]
    entry = calls[0].to_openai()
    assert entry["type"] == "function" and json.loads(entry["function"]["arguments"]) == {"city": "Paris"}
    assert entry["id"].startswith("call_") and entry["id"] != calls[1].to_openai()["id"]
    assert calls[0].to_message() == {
        "type": "function",
        "function": {"name": "weather", "arguments": {"city": "Paris"}},
    }


def test_malformed_or_unclosed_blocks_stay_content():
    for text in ("<tool_call>{not json}</tool_call>", '<tool_call>{"arguments": {}}</tool_call>',
                 '<tool_call>{"name": "x", "arguments": [1]}</tool_call>', '<tool_call>{"name": "x"',
                 "no calls at all"):
        assert parse_tool_calls(text) == (text, [])
    assert parse_tool_calls('<tool_call>{"name": "x"}</tool_call>')[1] == [ToolCall("x", {})]


def test_an_open_block_is_detected_for_streaming():
    assert has_open_tool_call('ok <tool_call>{"name": ')
    assert not has_open_tool_call('<tool_call>{"name": "x"}</tool_call> done')
    assert not has_open_tool_call("plain")
