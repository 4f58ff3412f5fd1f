"""How a choice looks in each OpenAI response kind, whole (a response's `choices`) or streamed (a
chunk's delta): `TextChoices` for `/v1/completions`, `ChatChoices` for `/v1/chat/completions`.

A whole choice is rendered from one delta that holds all of it (`whole_delta`), so both kinds share
the rest of the response path (`openai_api.py`): fan-out, SSE framing, usage, errors and `[DONE]`.

vLLM's extensions sit where vLLM puts them: `stop_reason` in every whole choice and in a streamed
choice's last chunk; with `return_token_ids`, `token_ids` (and our `token_weight_versions`) in every
choice, and `prompt_token_ids` in the completion choice (a stream: its first chunk) or at the top of a
chat response (a stream: its opening chunks); `prompt_logprobs` in the completion choice or at the
top of a chat response (never streamed: refused with `stream`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import defaultdict
from typing import Any

from inflight.chat.tool_calls import parse_tool_calls
from inflight.server.detokenize import ChoiceTracker, Delta
from inflight.server.logprobs import (
    TokenNamer,
    chat_logprobs,
    completion_logprobs,
    delta_logprobs,
    prompt_lists,
    vllm_prompt_logprobs,
)
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

    def stream_head(self, tracker: ChoiceTracker) -> dict[str, Any]:
        """Top-level fields of a choice's opening chunk."""
        return {}

    def whole_head(self, prompts: list[list[int]], trackers: list[ChoiceTracker]) -> dict[str, Any]:
        """Top-level fields of a whole response to `prompts`."""
        return {}

    def choice(self, delta: Delta, whole: bool, tracker: ChoiceTracker) -> dict[str, Any] | None:
        """The choice object of `delta`; None for a streamed delta that carries nothing to send."""
        carries = bool(delta.token_ids) and (self.token_ids or self.k is not None)
        if (
            not whole
            and not delta.finish_reason
            and not (delta.text or carries and tracker.prompt_scores_complete)
        ):
            return None  # prefill chunks' snapshots, text held back with nothing else to send
        fields, finish, visible = self._fields(delta, whole, tracker)
        if not (whole or visible or finish or carries):
            return None
        choice = {"index": delta.index, **fields, "finish_reason": finish}
        if whole or finish is not None:
            choice["stop_reason"] = tracker.stop_reason
        if self.token_ids:
            choice.update(token_ids=delta.token_ids, token_weight_versions=delta.token_weight_versions)
        return choice

    @abstractmethod
    def _fields(
        self, delta: Delta, whole: bool, tracker: ChoiceTracker
    ) -> tuple[dict[str, Any], str | None, bool]:
        """(the kind's fields, finish_reason, whether there is text or a call to send)."""


class TextChoices(Choices):
    """Completions: `text`, and `logprobs` with tokens, token_logprobs, top_logprobs and text_offset.
    With `echo` a choice's first piece starts with the prompt: its text, and in `logprobs` its tokens
    with their prompt scores."""

    object = chunk_object = "text_completion"
    id_prefix = "cmpl"

    def __init__(
        self, name: TokenNamer, top_logprobs: int | None, token_ids: bool, echo: bool = False
    ) -> None:
        super().__init__(name, top_logprobs, token_ids)
        self.echo = echo
        self._offsets: dict[int, int] = defaultdict(int)  # text sent so far, per choice
        self._started: set[int] = set()

    def whole_head(self, prompts: list[list[int]], trackers: list[ChoiceTracker]) -> dict[str, Any]:
        if not self.token_ids:  # vLLM has them per choice; the top-level copy is kept for older clients
            return {}
        return {"prompt_token_ids": prompts[0] if len(prompts) == 1 else prompts}

    def _fields(
        self, delta: Delta, whole: bool, tracker: ChoiceTracker
    ) -> tuple[dict[str, Any], str | None, bool]:
        first = delta.index not in self._started
        self._started.add(delta.index)
        echoed = self.echo and first
        text = (tracker.prompt_text if echoed else "") + delta.text
        fields: dict[str, Any] = {"text": text, "logprobs": self._logprobs(delta, tracker, echoed)}
        self._offsets[delta.index] += len(text)
        if self.token_ids and first:
            fields["prompt_token_ids"] = tracker.prompt_token_ids
        if whole:
            fields["prompt_logprobs"] = vllm_prompt_logprobs(self.name, tracker)
        return fields, delta.finish_reason, bool(text)

    def _logprobs(self, delta: Delta, tracker: ChoiceTracker, echoed: bool) -> dict[str, Any] | None:
        if self.k is None:
            return None
        offset = self._offsets[delta.index]
        if not echoed:
            return delta_logprobs(self.name, delta, self.k, offset)
        logprobs, tops = prompt_lists(tracker)
        out_tops = delta.top_logprobs if self.k > 0 else [[] for _ in delta.token_ids]
        return completion_logprobs(self.name, [*tracker.prompt_token_ids, *delta.token_ids],
                                   [*logprobs, *(delta.logprobs or [])], [*tops, *(out_tops or [])], offset)


class ChatChoices(Choices):
    """Chat: an assistant `message` (streamed: `delta`), with Hermes-format tool calls parsed out of
    the text into `tool_calls` (finish_reason "tool_calls") when the request's tools ask for it."""

    object, chunk_object, id_prefix = "chat.completion", "chat.completion.chunk", "chatcmpl"

    def __init__(
        self, name: TokenNamer, top_logprobs: int | None, token_ids: bool, parse_calls: bool
    ) -> None:
        super().__init__(name, top_logprobs, token_ids)
        self.parse_calls = parse_calls
        self._streams: dict[int, ToolCallStream] = defaultdict(ToolCallStream)

    def opening(self, index: int) -> dict[str, Any]:
        return {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                "finish_reason": None}

    def stream_head(self, tracker: ChoiceTracker) -> dict[str, Any]:
        return {"prompt_token_ids": tracker.prompt_token_ids} if self.token_ids else {}

    def whole_head(self, prompts: list[list[int]], trackers: list[ChoiceTracker]) -> dict[str, Any]:
        head: dict[str, Any] = {}
        if trackers[0].prompt_logprobs is not None:
            head["prompt_logprobs"] = vllm_prompt_logprobs(self.name, trackers[0])
        if self.token_ids:
            head["prompt_token_ids"] = trackers[0].prompt_token_ids
        return head

    def _fields(
        self, delta: Delta, whole: bool, tracker: ChoiceTracker
    ) -> tuple[dict[str, Any], str | None, bool]:
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
