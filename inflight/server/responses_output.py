"""A generation rendered as an OpenAI Responses object, whole or as its SSE events.

Output items: the text outside tool calls as one assistant `message` (an `output_text` part, with
`logprobs` when asked), then one `function_call` item per Hermes-format call (`call_id`, `name`,
`arguments` as a JSON string), as `/v1/chat/completions` parses them (`inflight.chat.tool_calls`).
Status `completed`; `incomplete` with `incomplete_details.reason = "max_output_tokens"` when the
generation hit its length, `incomplete` without a reason when a pause aborted it.

Streamed, the events are the ones the official client's `responses.create(stream=True)` and
`responses.stream` read, each with its `sequence_number`: `response.created`,
`response.in_progress`, per message `response.output_item.added`, `response.content_part.added`,
`response.output_text.delta`..., `response.output_text.done`, `response.content_part.done`,
`response.output_item.done`; per call `response.output_item.added`,
`response.function_call_arguments.delta` / `.done`, `response.output_item.done`; then
`response.completed` with the whole response, whatever its status (as vLLM: the client's
`get_final_response()` and agent loops wait for that event). A call is parsed as its
block closes (`tool_stream.py`), so a message that text after a call continues is a new item.
A failure after the status line is an `error` event.
"""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from inflight.chat.tool_calls import ToolCall, parse_tool_calls
from inflight.server.detokenize import ChoiceTracker, Delta
from inflight.server.errors import api_error_from
from inflight.server.generation import ticking
from inflight.server.logprobs import TokenNamer, chat_logprobs
from inflight.server.responses_input import ResponsesRequest
from inflight.server.tool_stream import ToolCallStream

SSE_KEEPALIVE_S = 10.0


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _message(item_id: str, text: str, logprobs: list[dict[str, Any]] | None, status: str) -> dict[str, Any]:
    part: dict[str, Any] = {"type": "output_text", "text": text, "annotations": []}
    if logprobs is not None:
        part["logprobs"] = logprobs
    return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": [part]}


def _function_call(call: ToolCall, status: str = "completed", arguments: str | None = None) -> dict[str, Any]:
    return {"id": _id("fc"), "type": "function_call", "call_id": call.id, "name": call.name,
            "arguments": json.dumps(call.arguments) if arguments is None else arguments, "status": status}


class ResponseRenderer:
    """One response's id, head fields and output, whole or streamed."""

    def __init__(self, req: ResponsesRequest, model: str, name: TokenNamer, top_logprobs: int | None,
                 parse_calls: bool) -> None:
        self.req, self.model, self.name = req, model, name
        self.k = top_logprobs
        self.parse_calls = parse_calls
        self.id = _id("resp")
        self.created_at = int(time.time())

    # ---- the response object ---------------------------------------------------------------
    def response(
        self, status: str, output: list[dict[str, Any]], tracker: ChoiceTracker | None
    ) -> dict[str, Any]:
        req = self.req
        incomplete = None
        if status == "incomplete" and tracker is not None:
            incomplete = {"reason": "max_output_tokens" if tracker.finish_reason == "length" else None}
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": None,
            "incomplete_details": incomplete,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "model": self.model,
            "output": output,
            "parallel_tool_calls": True,
            "previous_response_id": None,
            "reasoning": None,
            "store": False,
            "temperature": req.temperature,
            "top_p": req.top_p,
            "text": {"format": {"type": "text"}},
            "tool_choice": req.tool_choice or "auto",
            "tools": req.tools or [],
            "top_logprobs": req.top_logprobs,
            "truncation": "disabled",
            "metadata": req.metadata or {},
            "user": req.user,
            "usage": _usage(tracker) if tracker is not None else None,
        }

    @staticmethod
    def status(tracker: ChoiceTracker) -> str:
        return "completed" if tracker.finish_reason == "stop" else "incomplete"

    def _logprobs(self, delta: Delta) -> list[dict[str, Any]] | None:
        return chat_logprobs(self.name, delta, self.k)["content"] if self.k is not None else None

    def whole(self, tracker: ChoiceTracker, delta: Delta) -> dict[str, Any]:
        """The finished response, `delta` holding all of its output."""
        content, calls = parse_tool_calls(delta.text) if self.parse_calls else (delta.text, [])
        status = self.status(tracker)
        output = (
            [_message(_id("msg"), content, self._logprobs(delta), status)] if content or not calls else []
        )
        output += [_function_call(call) for call in calls]
        return self.response(status, output, tracker)

    # ---- the events -----------------------------------------------------------------------------
    async def events(self, deltas: AsyncIterator[Delta], tracker: ChoiceTracker) -> AsyncIterator[str]:
        """The SSE stream of the response whose deltas these are."""
        stream = _EventStream(self)
        try:
            yield stream.emit("response.created", response=self.response("in_progress", [], None))
            yield stream.emit("response.in_progress", response=self.response("in_progress", [], None))
            async with contextlib.aclosing(ticking(deltas, SSE_KEEPALIVE_S)) as items:
                async for delta in items:
                    if delta is None:
                        yield ": keep-alive\n\n"
                        continue
                    for event in stream.feed(delta):
                        yield event
            for event in stream.finish(tracker):
                yield event
        except Exception as err:  # the status line is gone: report in the stream
            api_err = api_error_from(err)
            yield stream.emit("error", code=api_err.code, message=api_err.message, param=api_err.param)
        finally:
            await deltas.aclose()


class _EventStream:
    """The events of one streamed response: items opened and closed as text and calls arrive."""

    def __init__(self, renderer: ResponseRenderer) -> None:
        self.r = renderer
        self.seq = 0
        self.output: list[dict[str, Any]] = []
        self.calls = ToolCallStream() if renderer.parse_calls else None
        self.open: dict[str, Any] | None = None  # the message item being streamed
        self.pending: list[dict[str, Any]] = []  # logprobs of tokens whose text has not been sent

    def emit(self, kind: str, **fields: Any) -> str:
        payload = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(payload, separators=(',', ':'))}\n\n"

    def feed(self, delta: Delta) -> list[str]:
        final = delta.finish_reason is not None
        text, calls = delta.text, []
        if self.calls is not None:
            before = len(self.calls.calls)
            text, _ = self.calls.feed(delta.text, final)
            calls = self.calls.calls[before:]
        self.pending += self.r._logprobs(delta) or []
        events = self._text(text) if text else []
        for call in calls:
            events += self._close()
            events += self._call(call)
        return events

    def _text(self, text: str) -> list[str]:
        events = []
        if self.open is None:
            self.open = _message(_id("msg"), "", [] if self.r.k is not None else None, "in_progress")
            self.open["content"][0]["text"] = ""
            index = len(self.output)
            events.append(self.emit("response.output_item.added", output_index=index,
                                    item={**self.open, "content": []}))
            events.append(
                self.emit(
                    "response.content_part.added",
                    item_id=self.open["id"],
                    output_index=index,
                    content_index=0,
                    part=dict(self.open["content"][0]),
                )
            )
        part = self.open["content"][0]
        part["text"] += text
        logprobs, self.pending = self.pending, []
        if "logprobs" in part:
            part["logprobs"] += logprobs
        events.append(
            self.emit(
                "response.output_text.delta",
                item_id=self.open["id"],
                output_index=len(self.output),
                content_index=0,
                delta=text,
                logprobs=logprobs,
            )
        )
        return events

    def _close(self, status: str = "completed") -> list[str]:
        if self.open is None:
            return []
        item, index = self.open, len(self.output)
        item["status"] = status
        part = item["content"][0]
        self.open = None
        self.output.append(item)
        return [
            self.emit("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                      text=part["text"], logprobs=part.get("logprobs", [])),
            self.emit("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                      part=part),
            self.emit("response.output_item.done", output_index=index, item=item),
        ]

    def _call(self, call: ToolCall) -> list[str]:
        item, index = _function_call(call), len(self.output)
        self.output.append(item)
        return [
            self.emit("response.output_item.added", output_index=index,
                      item={**item, "arguments": "", "status": "in_progress"}),
            self.emit("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                      delta=item["arguments"]),
            self.emit("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                      name=item["name"], arguments=item["arguments"]),
            self.emit("response.output_item.done", output_index=index, item=item),
        ]

    def finish(self, tracker: ChoiceTracker) -> list[str]:
        status = self.r.status(tracker)
        events = []
        # nothing was said: an empty message, as a whole response has
        if self.open is None and not self.output:
            events += self._text_empty()
        if self.open is not None and "logprobs" in self.open["content"][0]:  # tokens whose text never showed
            self.open["content"][0]["logprobs"] += self.pending
        events += self._close(status)
        # always `response.completed` (its status says incomplete), as vLLM sends it: the client's
        # `responses.stream(...).get_final_response()` and agent loops wait for that event
        return [
            *events,
            self.emit("response.completed", response=self.r.response(status, self.output, tracker)),
        ]

    def _text_empty(self) -> list[str]:
        events = self._text("")
        return events[:-1]  # opened, no empty delta


def _usage(tracker: ChoiceTracker) -> dict[str, Any]:
    prompt, output = len(tracker.prompt_token_ids), len(tracker.output_token_ids)
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": tracker.num_cached_tokens},
            "output_tokens": output, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + output}


__all__ = ["ResponseRenderer"]
