"""`/v1/responses` requests as the chat request they stand for: the Responses API is another
rendering of the same generation, so its body becomes a `ChatCompletionRequest` that the chat path
validates, templates and generates (`validation.check_chat`, `chat_prompt.py`, `tools.py`).

- `input`: a string (one user message) or a list of items: messages (`user`, `system`, `developer`
  as system, `assistant`; text content or `input_text`/`output_text` parts, `input_image` parts for a
  vision-language model, as chat's `image_url`), `function_call` items
  (the model's earlier calls, joined to the assistant turn they follow) and `function_call_output`
  items (a `tool` message with the call's `call_id`). `instructions` come first, as a system message.
- `tools`: function tools (`{"type": "function", "name", "parameters", ...}`) become chat tools;
  `tool_choice` `auto`/`none` as on chat (forcing a call is refused there, naming `tool_choice`).
- `max_output_tokens`, `temperature`, `top_p`, `top_logprobs` (with `include:
  ["message.output_text.logprobs"]`) map onto the chat fields; our chat extensions (`top_k`, `seed`,
  `ignore_eos`, `stop`, `cache_salt`, `chat_template_kwargs`, ...) pass through to the chat checks.
- Refused with a 400 naming the field: what needs stored responses (`previous_response_id`,
  `conversation`, `item_reference` items), `background`, stored `prompt` templates, built-in tools
  (web search, file search, computer use, MCP, ...), items and content the server cannot take
  (files, audio, reasoning items), and any other non-default option (`RESPONSES_REFUSED`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from inflight.server.errors import APIError
from inflight.server.protocol import ChatCompletionRequest
from inflight.server.unsupported import METADATA, REFUSED

LOGPROBS_INCLUDE = "message.output_text.logprobs"
# our chat extensions a Responses body may carry (they mean what they mean on chat)
PASSTHROUGH = frozenset(
    {
        "top_k",
        "seed",
        "ignore_eos",
        "stop",
        "stop_token_ids",
        "include_stop_str_in_output",
        "cache_salt",
        "skip_special_tokens",
        "chat_template",
        "chat_template_kwargs",
        "add_special_tokens",
        "return_tokens_as_token_ids",
    }
)
TEXT_PARTS = ("input_text", "output_text", "text")
IMAGE_PART = "input_image"  # `image_url`: a data: URL; decoded and checked on the chat path
FUNCTION_KEYS = ("name", "description", "parameters", "strict")


def _off(value: Any) -> bool:
    return value is None or value is False or value == [] or value == {}


RESPONSES_REFUSED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "previous_response_id": (_off, "this server stores no responses; send the whole conversation in `input`"),
    "conversation": (_off, "this server stores no conversations; send the whole conversation in `input`"),
    "background": (_off, "background responses are not supported; send stream=true or wait for the answer"),
    "prompt": (_off, "stored prompt templates are not supported; send `instructions` and `input`"),
    "max_tool_calls": (_off, "max_tool_calls is not implemented (the model's calls come back to you)"),
    "context_management": (_off, "context management (compaction) is not supported"),
    "prompt_cache_options": (_off, "prompt cache options are not supported (the prefix cache is automatic)"),
    "moderation": (_off, "moderation is not supported"),
    "image": (_off, "image options are not supported (text only)"),
    "access_programs": (_off, "access programs are not supported"),
    "background_options": (_off, "background responses are not supported"),
    "truncation": (
        lambda v: v in (None, "disabled"),
        "the input is never truncated; use 'disabled' or omit it",
    ),
    "reasoning": (
        lambda v: _off(v) or isinstance(v, dict) and all(x is None for x in v.values()),
        'reasoning options are not supported; use chat_template_kwargs (e.g. {"enable_thinking": false})',
    ),
    "text": (
        lambda v: _off(v) or v == {"format": {"type": "text"}},
        "structured outputs are not implemented; only text.format {'type': 'text'}",
    ),
    "stream_options": (
        lambda v: (
            _off(v)
            or isinstance(v, dict)
            and set(v) <= {"include_obfuscation"}
            and not v.get("include_obfuscation")
        ),
        "stream obfuscation is not implemented; send include_obfuscation=false or omit it",
    ),
}


class ResponsesRequest(BaseModel):
    """The body of `/v1/responses` (OpenAI's fields this server reads; others are checked by name)."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: str | list[Any]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = None
    include: list[str] | None = None
    stream: bool = False
    store: bool | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None

    @property
    def wants_logprobs(self) -> bool:
        return LOGPROBS_INCLUDE in (self.include or [])


def _bad(message: str, param: str, code: str = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


def _text(content: Any, param: str) -> str | list[dict[str, Any]]:
    """A message's content as text: a string, or text parts joined; with `input_image` parts, chat
    content parts (text, and the image parts as sent: the chat path decodes them)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(f"{param} must be a string or a list of content parts", param)
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == IMAGE_PART:
            parts.append(part)
        elif kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise _bad(
                f"{param}[{j}] of type {kind!r} is not supported: this server takes text parts "
                f"({', '.join(TEXT_PARTS)}) and {IMAGE_PART}",
                f"{param}[{j}].type",
                "unsupported_content",
            )
        else:
            parts.append({"type": "text", "text": part["text"]})
    if any(p["type"] == IMAGE_PART for p in parts):
        return parts
    return "".join(p["text"] for p in parts)


def _call_entry(item: dict[str, Any], param: str) -> dict[str, Any]:
    name, arguments = item.get("name"), item.get("arguments", "{}")
    if not isinstance(name, str) or not isinstance(arguments, str):
        raise _bad(f"{param} must have a string `name` and `arguments` (a JSON string)", param)
    return {"id": item.get("call_id") or item.get("id") or "", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def input_messages(req: ResponsesRequest) -> list[dict[str, Any]]:
    """`instructions` and `input` as chat messages."""
    messages: list[dict[str, Any]] = []
    if req.instructions:
        messages.append({"role": "system", "content": req.instructions})
    if isinstance(req.input, str):
        return [*messages, {"role": "user", "content": req.input}]
    for i, item in enumerate(req.input):
        param = f"input[{i}]"
        if not isinstance(item, dict):
            raise _bad(f"{param} must be an object (a message or an item)", param)
        kind = item.get("type", "message")
        if kind == "message":
            role = {"developer": "system"}.get(item.get("role"), item.get("role"))
            if role not in ("user", "system", "assistant"):
                raise _bad(f"{param}.role={item.get('role')!r} must be user, system, developer or assistant",
                           f"{param}.role")
            messages.append({"role": role, "content": _text(item.get("content"), f"{param}.content")})
        elif kind == "function_call":
            entry = _call_entry(item, param)
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":  # the calls of one assistant turn
                last.setdefault("tool_calls", []).append(entry)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [entry]})
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": item.get("call_id") or "",
                             "content": _text(output, f"{param}.output")})
        else:
            why = ("it refers to a stored item; send the item itself" if kind == "item_reference" else
                   "this server takes messages, function_call and function_call_output items only")
            raise _bad(
                f"{param}.type={kind!r} is not supported: {why}", f"{param}.type", "unsupported_parameter"
            )
    return messages


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Responses function tools as chat tools; anything else is a 400 naming it."""
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function":
            raise _bad(
                f"tools[{i}].type={tool.get('type')!r} is not supported: this server runs no built-in "
                "tools (web search, file search, computer use, MCP, code interpreter, ...); only "
                "function tools, whose calls come back to you",
                f"tools[{i}].type",
                "unsupported_parameter",
            )
        extra = [k for k, v in tool.items() if k not in (*FUNCTION_KEYS, "type") and v is not None]
        if extra:
            raise _bad(f"tools[{i}].{extra[0]} is not supported by this server", f"tools[{i}].{extra[0]}",
                       "unsupported_parameter")
        out.append(
            {"type": "function", "function": {k: tool[k] for k in FUNCTION_KEYS if tool.get(k) is not None}}
        )
    return out


def _check_options(req: ResponsesRequest) -> dict[str, Any]:
    """The Responses-only fields: refused ones by name; returns the extensions to pass to chat."""
    values = {name: getattr(req, name) for name in type(req).model_fields}
    values.update(req.model_extra or {})
    for name, value in values.items():
        if name in RESPONSES_REFUSED and not RESPONSES_REFUSED[name][0](value):
            raise APIError(
                400,
                f"{name}={value!r} is not supported by this server: {RESPONSES_REFUSED[name][1]}",
                param=name,
                code="unsupported_parameter",
            )
    passed = {}
    for name, value in (req.model_extra or {}).items():
        if name in PASSTHROUGH or name in REFUSED:
            passed[name] = value
        elif name not in RESPONSES_REFUSED and name not in METADATA and name != "prompt_cache_retention":
            raise APIError(400, f"unrecognized request argument supplied: {name}", param=name,
                           code="unknown_parameter")
    unknown = [x for x in req.include or [] if x != LOGPROBS_INCLUDE]
    if unknown:
        raise _bad(f"include={unknown[0]!r} is not supported; only {LOGPROBS_INCLUDE!r}", "include",
                   "unsupported_parameter")
    if req.top_logprobs is not None and not req.wants_logprobs:
        raise _bad(f"top_logprobs needs include=[{LOGPROBS_INCLUDE!r}]", "top_logprobs")
    return passed


CHAT_PARAMS = {
    "messages": "input",
    "max_completion_tokens": "max_output_tokens",
    "max_tokens": "max_output_tokens",
}


def responses_param(param: str | None) -> str | None:
    """A chat error's field as the Responses body names it."""
    if param is None:
        return None
    root, dot, rest = param.partition(".")
    head = root.split("[", 1)[0]
    return CHAT_PARAMS.get(head, head) + root[len(head):] + dot + rest if head in CHAT_PARAMS else param


def to_chat_request(req: ResponsesRequest) -> ChatCompletionRequest:
    """The chat request this Responses request stands for; raises APIError naming the bad field."""
    passed = _check_options(req)
    body = {
        "model": req.model,
        "messages": input_messages(req),
        "tools": chat_tools(req.tools),
        "tool_choice": req.tool_choice,
        "parallel_tool_calls": req.parallel_tool_calls,
        "max_completion_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "logprobs": req.wants_logprobs,
        "top_logprobs": req.top_logprobs if req.wants_logprobs else None,
        "stream": req.stream,
        **passed,
    }
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(x) for x in first["loc"])
        raise _bad(f"invalid request: {where}: {first['msg']}", responses_param(where) or where) from err


__all__ = ["LOGPROBS_INCLUDE", "RESPONSES_REFUSED", "ResponsesRequest", "input_messages", "responses_param",
           "to_chat_request"]
