"""Chat messages (and tools) to prompt token ids, through the model's own chat template.

Text content parts are joined; an assistant message's `tool_calls` get their JSON-string arguments
as objects (see `tools.py`); `tool` messages pass through with their `tool_call_id`. The rendered
text is tokenized without special tokens unless `add_special_tokens` asks (the template writes
them), which is what `tokenizer.apply_chat_template(..., tokenize=True)` gives.
"""

from __future__ import annotations

from typing import Any

from inflight.server.errors import APIError
from inflight.server.protocol import ChatCompletionRequest, ChatMessage
from inflight.server.tools import template_tool_calls


def _message(i: int, m: ChatMessage) -> dict[str, Any]:
    message = m.model_dump(exclude_none=True)
    if isinstance(m.content, list):
        texts = []
        for part in m.content:
            if part.type != "text" or part.text is None:
                raise APIError(400, f"content part type {part.type!r} is not supported (only 'text')",
                               param=f"messages[{i}].content", code="unsupported_content")
            texts.append(part.text)
        message["content"] = "".join(texts)
    elif m.content is None:
        message["content"] = ""
    if message.get("tool_calls") is not None:
        message["tool_calls"] = template_tool_calls(message["tool_calls"], f"messages[{i}].tool_calls")
    return message


def _render(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
            req: ChatCompletionRequest) -> str:
    kwargs = dict(req.chat_template_kwargs or {})
    if req.chat_template is not None:
        kwargs["chat_template"] = req.chat_template
    try:
        return tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=False,
            add_generation_prompt=req.add_generation_prompt and not req.continue_final_message,
            continue_final_message=req.continue_final_message, **kwargs,
        )
    except Exception as err:  # jinja errors, a missing template, bad kwargs
        raise APIError(400, f"cannot apply the chat template: {err}", param="messages",
                       code="invalid_messages") from err


def template_messages(req: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The request's messages as the chat template reads them (text parts joined, tool-call
    arguments as objects); raises APIError(400) naming what is wrong."""
    if not req.messages:
        raise APIError(400, "messages must not be empty", param="messages", code="invalid_value")
    return [_message(i, m) for i, m in enumerate(req.messages)]


def chat_prompt(tokenizer: Any, req: ChatCompletionRequest) -> list[int]:
    """The prompt token ids of a chat request; raises APIError(400) naming what is wrong."""
    messages = template_messages(req)
    text = _render(tokenizer, messages, req.tools or None, req)
    if req.tools and _render(tokenizer, messages, None, req) == text:
        raise APIError(400, "this model's chat template renders nothing for `tools`, so the model would "
                       "never see them; serve a model whose template takes tools (Qwen2.5, Qwen3, Hermes) "
                       "or pass one in `chat_template`", param="tools", code="unsupported_parameter")
    ids = tokenizer(text, add_special_tokens=req.add_special_tokens)["input_ids"]
    if not ids:
        raise APIError(400, "the messages render to an empty prompt", param="messages", code="invalid_value")
    return list(ids)
