"""How a choice looks in each OpenAI response kind, whole (a response's `choices`) or streamed (a
chunk's delta): `TextChoices` for `/v1/completions`, `ChatChoices` for `/v1/chat/completions`.

A whole choice is rendered from one delta that holds all of it (`whole_delta`), so both kinds share
the rest of the response path (`openai_api.py`): fan-out, SSE framing, usage, errors and `[DONE]`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import defaultdict
from typing import Any

from inflight.chat.tool_calls import parse_tool_calls
from inflight.server.detokenize import ChoiceTracker, Delta
from inflight.server.logprobs import TokenNamer, chat_logprobs, completion_logprobs
from inflight.server.tool_stream import ToolCallStream


def whole_delta(t: ChoiceTracker) -> Delta:
    """A finished choice as one delta."""
    return Delta(t.index, t.text, t.output_token_ids, t.logprobs, t.token_weight_versions, t.finish_reason,
                 t.top_logprobs)


class Choices(ABC):
    """Renders one response's choices. `top_logprobs`: None when the request asked for no logprobs,
    else the number of alternatives per token; `token_ids`: the `return_token_ids` extension."""

    object = chunk_object = id_prefix = ""

    def __init__(self, name: TokenNamer, top_logprobs: int | None, token_ids: bool) -> None:
        self.name = name
        self.k = top_logprobs
        self.token_ids = token_ids

    def opening(self, index: int) -> dict[str, Any] | None:
        """The chunk a stream sends for a choice before its first token (None: nothing)."""
        return None

    def choice(self, delta: Delta, whole: bool) -> dict[str, Any] | None:
        """The choice object of `delta`; None for a streamed delta that carries nothing to send."""
        fields, finish, visible = self._fields(delta, whole)
        if not (whole or visible or finish or self.token_ids or self.k is not None):
            return None
        choice = {"index": delta.index, **fields, "finish_reason": finish}
        if self.token_ids:
            choice.update(token_ids=delta.token_ids, token_weight_versions=delta.token_weight_versions)
        return choice

    @abstractmethod
    def _fields(self, delta: Delta, whole: bool) -> tuple[dict[str, Any], str | None, bool]:
        """(the kind's fields, finish_reason, whether there is text or a call to send)."""


class TextChoices(Choices):
    """Completions: `text`, and `logprobs` with tokens, token_logprobs, top_logprobs and text_offset."""

    object = chunk_object = "text_completion"
    id_prefix = "cmpl"

    def __init__(self, name: TokenNamer, top_logprobs: int | None, token_ids: bool) -> None:
        super().__init__(name, top_logprobs, token_ids)
        self._offsets: dict[int, int] = defaultdict(int)  # text sent so far, per choice

    def _fields(self, delta: Delta, whole: bool) -> tuple[dict[str, Any], str | None, bool]:
        offset = self._offsets[delta.index]
        self._offsets[delta.index] += len(delta.text)
        lp = completion_logprobs(self.name, delta, self.k, offset) if self.k is not None else None
        return {"text": delta.text, "logprobs": lp}, delta.finish_reason, bool(delta.text)


class ChatChoices(Choices):
    """Chat: an assistant `message` (streamed: `delta`), with Hermes-format tool calls parsed out of
    the text into `tool_calls` (finish_reason "tool_calls") when the request's tools ask for it."""

    object, chunk_object, id_prefix = "chat.completion", "chat.completion.chunk", "chatcmpl"

    def __init__(self, name: TokenNamer, top_logprobs: int | None, token_ids: bool, parse_calls: bool) -> None:
        super().__init__(name, top_logprobs, token_ids)
        self.parse_calls = parse_calls
        self._streams: dict[int, ToolCallStream] = defaultdict(ToolCallStream)

    def opening(self, index: int) -> dict[str, Any]:
        return {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                "finish_reason": None}

    def _fields(self, delta: Delta, whole: bool) -> tuple[dict[str, Any], str | None, bool]:
        lp = chat_logprobs(self.name, delta, self.k) if self.k is not None else None
        text, finish, calls = delta.text, delta.finish_reason, []
        if whole:  # the text outside the calls; null when nothing is left, as OpenAI sends it
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if self.parse_calls:
                content, parsed = parse_tool_calls(text)
                if parsed:
                    message.update(content=content or None, tool_calls=[c.to_openai() for c in parsed])
                    finish = "tool_calls"
            return {"message": message, "logprobs": lp}, finish, True
        if self.parse_calls:
            stream = self._streams[delta.index]
            text, calls = stream.feed(text, final=finish is not None)
            if finish is not None and stream.calls:
                finish = "tool_calls"
        message = {"content": text} if text else {}
        if calls:
            message["tool_calls"] = calls
        return {"delta": message, "logprobs": lp}, finish, bool(text or calls)


__all__ = ["ChatChoices", "Choices", "TextChoices", "whole_delta"]
