"""A session's next prompt from the tokens the model sampled, when the agent sent back its history.

An agent resends the whole conversation with every call. Rendering it through the chat template
again would re-tokenise the model's earlier replies (which need not give back the ids it sampled:
a tool call's JSON re-serialised, a merge across the reply's boundary) and the samples would no
longer extend each other. So when a chat request's messages are a recorded call's messages, then
the assistant reply that call returned (its text and tool calls, as the client got them), then only
new non-assistant messages (tool results, a user turn), the prompt is that call's prompt, its
sampled ids verbatim and the tokens the template writes after an assistant turn for the new messages
(`inflight.chat.turns.between_turns`; the template's end-of-turn token dropped when the model sampled
it). Same tools, same template and arguments, a generation prompt. Anything else (an edited or
dropped message, other tools, a reply the agent changed) is rendered from scratch: a new sample.

A text completion continues a recorded one when its prompt is that call's prompt and reply text,
then more text: the recorded ids, then the rest's tokens (no special tokens added).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from inflight.agents.records import CallRecord, ChatTurn
from inflight.chat.tool_calls import parse_tool_calls
from inflight.chat.turns import ChatFormat, between_turns, encode

IGNORED_KEYS = ("id", "tool_call_id")


def _call(call: dict[str, Any]) -> tuple[str, str]:
    function = call.get("function", call)
    return str(function.get("name")), json.dumps(function.get("arguments", {}), sort_keys=True)


def canonical(message: dict[str, Any]) -> tuple[Any, ...]:
    """A template-ready message in a comparable form: role, content ("" for none), each tool call as
    (name, arguments as sorted JSON), and its other fields; call ids are left out (a reply's ids are
    made per response)."""
    calls = tuple(_call(c) for c in message.get("tool_calls") or ())
    others = tuple(sorted((k, json.dumps(v, sort_keys=True)) for k, v in message.items()
                          if k not in ("role", "content", "tool_calls", *IGNORED_KEYS) and v is not None))
    return message.get("role"), message.get("content") or "", calls, others


def reply(text: str, parse_calls: bool) -> tuple[Any, ...]:
    """The assistant message a reply's text became, canonical (tool calls parsed when the request's
    tools ask for it, as the chat routes do)."""
    if not parse_calls:
        return canonical({"role": "assistant", "content": text})
    content, calls = parse_tool_calls(text)
    if not calls:
        return canonical({"role": "assistant", "content": text})
    return canonical({"role": "assistant", "content": content, "tool_calls": [c.to_message() for c in calls]})


def template_key(fmt: ChatFormat) -> tuple[str | None, str]:
    return fmt.template, json.dumps(dict(fmt.kwargs), sort_keys=True, default=str)


def continue_chat(records: Sequence[CallRecord], tokenizer: Any, rendered: list[dict[str, Any]],
                  tools: Any, fmt: ChatFormat) -> list[int] | None:
    """The prompt ids continuing the latest recorded chat call that `rendered` (the request's messages
    as the template reads them) extends with new messages, or None (render from scratch)."""
    messages = [canonical(m) for m in rendered]
    key = template_key(fmt)
    for record in reversed(records):
        turn = record.chat
        if turn is None or turn.tools != tools or turn.template != key or not record.output_ids:
            continue
        k = len(turn.messages)
        if len(messages) < k + 2 or tuple(messages[:k]) != turn.messages or messages[k] != turn.reply:
            continue
        new = rendered[k + 1:]
        if any(m.get("role") == "assistant" for m in new):
            continue
        ids = between_turns(tokenizer, list(turn.rendered), new, tools, fmt)
        if ids and record.finish_reason == "stop" and ids[0] == record.output_ids[-1]:
            ids = ids[1:]  # the model sampled the end of its turn: the template's copy goes
        return [*record.tokens, *ids]
    return None


def continue_text(records: Sequence[CallRecord], tokenizer: Any, text: str) -> list[int] | None:
    """The prompt ids continuing the latest recorded text completion that `text` extends, or None."""
    for record in reversed(records):
        if record.text is None:
            continue
        said = record.text[0] + record.text[1]
        if len(text) > len(said) and text.startswith(said):
            return [*record.tokens, *encode(tokenizer, text[len(said):])]
    return None


def chat_turn(
    rendered: list[dict[str, Any]], tools: Any, fmt: ChatFormat, text: str, parse_calls: bool
) -> ChatTurn:
    """What a finished chat call's successor must repeat (see `continue_chat`)."""
    return ChatTurn(tuple(canonical(m) for m in rendered), tuple(rendered), tools, template_key(fmt),
                    reply(text, parse_calls))


__all__ = ["canonical", "chat_turn", "continue_chat", "continue_text", "reply", "template_key"]
