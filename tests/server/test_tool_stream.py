"""ToolCallStream: whatever the chunking of the text, the streamed content and calls reassemble to
what the shared parser (`parse_tool_calls`) gives for the whole text."""

from __future__ import annotations

import json
import random

import pytest

from inflight.chat.tool_calls import parse_tool_calls
from inflight.server.tool_stream import ToolCallStream

CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
OTHER = '<tool_call>{"name": "neg", "arguments": "{\\"x\\": 3}"}</tool_call>'
TEXTS = [
    "no tools here, just text < and <tool but not a tag",
    f"Let me add.\n{CALL}",
    f"{CALL}\n{OTHER}\n",
    f"{CALL}\n  then text after the call",
    f"first {CALL} between  {OTHER} after",
    f"a broken block <tool_call>not json</tool_call> then {CALL}",
    f"{CALL} and a truncated <tool_call>" + '{"name": "add"',
    "only a truncated one <tool_call>{",
    f"ends on a partial tag {CALL} <tool_ca",
]


def chunkings(text: str, seed: int) -> list[list[str]]:
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, 7)))
    return [list(text), [text], [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]]


def run(chunks: list[str]) -> tuple[str, list[dict], list[str]]:
    stream, content, entries, sent = ToolCallStream(), "", [], []
    for i, chunk in enumerate(chunks):
        text, new = stream.feed(chunk, final=i == len(chunks) - 1)
        content += text
        entries += new
        sent.append(content)
    return content, entries, sent


@pytest.mark.parametrize("text", TEXTS)
def test_stream_reassembles_to_the_parser_output(text):
    want_content, want_calls = parse_tool_calls(text)
    for chunks in chunkings(text, seed=len(text)):
        content, entries, sent = run(chunks)
        assert [e["index"] for e in entries] == list(range(len(want_calls)))
        assert [(e["function"]["name"], json.loads(e["function"]["arguments"])) for e in entries] == [
            (c.name, c.arguments) for c in want_calls]
        assert all(e["type"] == "function" and e["id"].startswith("call_") for e in entries)
        assert content == want_content  # none of TEXTS starts with white space
        # nothing sent is ever taken back: a valid block's text (not content) is never sent, in part or whole
        assert all(want_content.startswith(s) for s in sent)
