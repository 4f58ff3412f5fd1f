"""Tool calls out of a streamed response: text deltas in, content deltas and finished calls out.

Calls are parsed with the shared Hermes parser (`inflight.chat.tool_calls`) one closed
`<tool_call>...</tool_call>` block at a time, the way `parse_tool_calls` walks the whole text, so
the calls equal the non-streaming ones. While a block is open (or the text ends in what may become
`<tool_call>`) its text is held back; a block that is not a valid call, or is still open at the
end, comes out as content, as `parse_tool_calls` leaves it.

Content: the non-streaming message strips the white space the blocks leave around them. Streaming
holds white space back until more content follows it, drops what is left at the end when the
response made calls, and drops white space that leads content coming after a call, so the streamed
content equals the non-streaming content, except for white space at the very start of a response
that makes calls later (streamed before any call is known).
"""

from __future__ import annotations

from typing import Any

from inflight.chat.tool_calls import TOOL_CALL_CLOSE, TOOL_CALL_OPEN, ToolCall, parse_tool_calls


def _partial_open(text: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of the opening tag."""
    for k in range(min(len(text), len(TOOL_CALL_OPEN) - 1), 0, -1):
        if text.endswith(TOOL_CALL_OPEN[:k]):
            return k
    return 0


class ToolCallStream:
    """One choice's streamed text, split into content and tool calls."""

    def __init__(self) -> None:
        self.text = ""
        self.consumed = 0  # text before this is content handed on or a parsed call
        self.calls: list[ToolCall] = []
        self._held_space = ""
        self._sent_any = False

    def feed(self, delta: str, final: bool) -> tuple[str, list[dict[str, Any]]]:
        """Add a text delta; returns (content to send, new `tool_calls` delta entries)."""
        self.text += delta
        content: list[str] = []
        first_new = len(self.calls)
        while True:
            rest = self.text[self.consumed :]
            start = rest.find(TOOL_CALL_OPEN)
            if start < 0:
                keep = 0 if final else _partial_open(rest)
                content.append(self._content(rest[: len(rest) - keep]))
                self.consumed += len(rest) - keep
                break
            content.append(self._content(rest[:start]))
            self.consumed += start
            rest = rest[start:]
            if TOOL_CALL_CLOSE not in rest:  # inside an open block: hold it back
                if final:  # never closed: content, as parse_tool_calls leaves it
                    content.append(self._content(rest))
                    self.consumed += len(rest)
                break
            block = rest[: rest.index(TOOL_CALL_CLOSE) + len(TOOL_CALL_CLOSE)]
            _, calls = parse_tool_calls(block)
            if calls:
                self.calls.extend(calls)
            else:
                content.append(self._content(block))
            self.consumed += len(block)
        if final and not self.calls:
            content.append(self._held_space)
            self._held_space = ""
        entries = [{"index": i, **call.to_openai()} for i, call in enumerate(self.calls) if i >= first_new]
        return "".join(content), entries

    def _content(self, text: str) -> str:
        """Content to send now: white space waits until non-space content follows it."""
        if not text:
            return ""
        core = len(text.rstrip())
        if core == 0:
            self._held_space += text
            return ""
        out = self._held_space + text[:core]
        self._held_space = text[core:]
        if not self._sent_any and self.calls:  # the content will start after a call: strip it
            out = out.lstrip()
        self._sent_any = True
        return out


__all__ = ["ToolCallStream"]
