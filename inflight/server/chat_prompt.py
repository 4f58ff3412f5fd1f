"""Chat messages (and tools) to prompt token ids, through the model's own chat template.

Text content parts are joined; an assistant message's `tool_calls` get their JSON-string arguments
as objects (see `tools.py`); `tool` messages pass through with their `tool_call_id`. The rendered
text is tokenized without special tokens unless `add_special_tokens` asks (the template writes
them), which is what `tokenizer.apply_chat_template(..., tokenize=True)` gives.

Image parts (`image_url`, and the Responses API's `input_image`) need a vision-language model
(`Vision`: its processor and the server's image limits; a text-only model answers 400): each image is
decoded and checked once (`inflight.chat.images`), the template renders its placeholder, and the
processor expands the placeholders and makes the image tensors. The prompt is then an `ImageIds`:
the token ids with their `multimodal` input for the engine.
"""

from __future__ import annotations

from typing import Any

from inflight.chat.images import ImageError, is_image_part
from inflight.chat.vision import Vision
from inflight.engine.multimodal import MultimodalInput
from inflight.server.errors import APIError
from inflight.server.protocol import ChatCompletionRequest, ChatMessage
from inflight.server.tools import template_tool_calls


class ImageIds(list):
    """A prompt's token ids (image placeholders expanded) with its images, `multimodal`."""

    def __init__(self, ids: list[int], multimodal: MultimodalInput) -> None:
        super().__init__(ids)
        self.multimodal = multimodal


def _message(i: int, m: ChatMessage, vision: Vision | None) -> dict[str, Any]:
    message = m.model_dump(exclude_none=True)
    if isinstance(m.content, list):
        texts, has_images = [], False
        for j, part in enumerate(message["content"]):
            if is_image_part(part):
                if vision is None:
                    raise APIError(
                        400,
                        f"messages[{i}].content[{j}] is an image, but this model is text-only "
                        "(it has no image processor); send text parts only, or serve a vision-language "
                        "model",
                        param=f"messages[{i}].content[{j}]",
                        code="unsupported_content",
                    )
                has_images = True
            elif part.get("type") != "text" or part.get("text") is None:
                raise APIError(400, f"content part type {part.get('type')!r} is not supported (only 'text'"
                               f"{', image_url' if vision is not None else ''})",
                               param=f"messages[{i}].content[{j}]", code="unsupported_content")
            else:
                texts.append(part["text"])
        if not has_images:
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


def template_messages(req: ChatCompletionRequest, vision: Vision | None = None) -> list[dict[str, Any]]:
    """The request's messages as the chat template reads them (text parts joined unless a message
    holds images, tool-call arguments as objects); raises APIError(400) naming what is wrong."""
    if not req.messages:
        raise APIError(400, "messages must not be empty", param="messages", code="invalid_value")
    return [_message(i, m, vision) for i, m in enumerate(req.messages)]


def chat_prompt(tokenizer: Any, req: ChatCompletionRequest, vision: Vision | None = None) -> list[int]:
    """The prompt token ids of a chat request (an `ImageIds` when it holds images; `vision`: the
    model's, None for a text-only model); raises APIError(400) naming what is wrong."""
    messages = template_messages(req, vision)
    images = []
    if vision is not None and any(is_image_part(p) for m in messages if isinstance(m["content"], list)
                                  for p in m["content"]):
        try:
            split = vision.split(messages)
        except ImageError as err:
            raise APIError(400, str(err), param=err.where, code=err.code) from None
        messages, images = split.messages, split.images
    text = _render(tokenizer, messages, req.tools or None, req)
    if req.tools and _render(tokenizer, messages, None, req) == text:
        raise APIError(400, "this model's chat template renders nothing for `tools`, so the model would "
                       "never see them; serve a model whose template takes tools (Qwen2.5, Qwen3, Hermes) "
                       "or pass one in `chat_template`", param="tools", code="unsupported_parameter")
    if images:
        return _image_prompt(vision, text, images, req.add_special_tokens)
    ids = tokenizer(text, add_special_tokens=req.add_special_tokens)["input_ids"]
    if not ids:
        raise APIError(400, "the messages render to an empty prompt", param="messages", code="invalid_value")
    return list(ids)


def _image_prompt(vision: Vision, text: str, images: list[Any], add_special_tokens: bool) -> ImageIds:
    try:
        prompt = vision.expand(text, images, add_special_tokens)
    except ValueError as err:  # the processor's: e.g. the template wrote no placeholder for an image
        raise APIError(400, f"the model's processor cannot take these images: {err}", param="messages",
                       code="invalid_image") from err
    return ImageIds(prompt.token_ids, MultimodalInput(prompt.pixel_values, prompt.image_grid_thw))
