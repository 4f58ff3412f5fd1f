"""`/tokenize`, `/detokenize` and `/tokenizer_info`, with vLLM's request and response shapes.

`/tokenize` takes a `prompt` (tokenized as `/v1/completions` does, `add_special_tokens` true by
default) or chat `messages` (rendered by the chat path itself, `chat_prompt.py`, with
`add_generation_prompt`, `continue_final_message`, `add_special_tokens` false by default, `tools`,
`chat_template`, `chat_template_kwargs`), never both; it answers `{count, max_model_len, tokens,
token_strs}` (`token_strs`, the tokenizer's token strings, with `return_token_strs`). `/detokenize`
takes `tokens` and answers `{prompt}`, decoded as an echoed token prompt is. Both run the tokenizer
in a thread, never on the event loop. `/tokenizer_info` gives the tokenizer's class, special tokens
and chat template (vLLM's behind `--enable-tokenizer-info-endpoint`): with it and `/tokenize`,
lm-eval's `local-completions` needs no local copy of the tokenizer.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Depends
from pydantic import BaseModel, ConfigDict

from inflight.server.chat_prompt import chat_prompt
from inflight.server.errors import APIError
from inflight.server.protocol import ChatCompletionRequest, ChatMessage
from inflight.server.tools import parses_tool_calls
from inflight.server.validation import check_chat_template, check_model, invalid_unicode

CHAT_FIELDS = (
    "tools",
    "add_generation_prompt",
    "continue_final_message",
    "chat_template",
    "chat_template_kwargs",
)


class TokenizeRequest(BaseModel):
    """vLLM's TokenizeCompletionRequest (`prompt`) or TokenizeChatRequest (`messages`) in one body."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: true for a prompt, false for messages (vLLM's)
    return_token_strs: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[dict[str, Any]] | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    tokens: list[int]


def _tokens(ctx: Any, req: TokenizeRequest) -> list[int]:
    """Worker thread: the request's token ids."""
    if req.prompt is not None:
        add_special = True if req.add_special_tokens is None else req.add_special_tokens
        return list(ctx.tokenizer(req.prompt, add_special_tokens=add_special)["input_ids"])
    chat = ChatCompletionRequest(messages=req.messages or [], add_special_tokens=bool(req.add_special_tokens),
                                 **{f: getattr(req, f) for f in CHAT_FIELDS})
    parses_tool_calls(chat)  # the tools' shape, checked as on /v1/chat/completions
    return list(chat_prompt(ctx.tokenizer, chat, ctx.vision))


def _check_tokenize(ctx: Any, req: TokenizeRequest) -> None:
    check_model(req.model, ctx.model_check)
    if (where := invalid_unicode(req.model_dump(exclude_none=True))) is not None:
        raise APIError(400, f"{where} is not valid Unicode; send UTF-8 text", param=where.split(".")[0],
                       code="invalid_value")
    if (req.prompt is None) == (req.messages is None):
        raise APIError(400, "send either `prompt` (a string) or `messages` (a chat), not both or neither",
                       param="prompt", code="invalid_value")
    if req.prompt is not None:
        chat_only = [f for f in CHAT_FIELDS if f in req.model_fields_set]
        if chat_only:
            raise APIError(400, f"{chat_only[0]} applies to `messages` only", param=chat_only[0],
                           code="invalid_value")
    elif req.add_generation_prompt and req.continue_final_message:
        raise APIError(400, "add_generation_prompt and continue_final_message cannot both be true",
                       param="continue_final_message", code="invalid_value")
    check_chat_template(req.chat_template, ctx.trust_request_chat_template)


def _detokenize(ctx: Any, req: DetokenizeRequest) -> str:
    vocab = ctx.vocab_size
    bad = [t for t in req.tokens if not 0 <= t < vocab]
    if bad:
        raise APIError(400, f"tokens {bad[:5]} are outside the vocabulary [0, {vocab})", param="tokens",
                       code="invalid_value")
    return ctx.tokenizer.decode(req.tokens, skip_special_tokens=False)


def _tokenizer_info(tokenizer: Any) -> dict[str, Any]:
    """vLLM's `/tokenizer_info` (what lm-eval's remote tokenizer reads): the tokenizer's class, special
    tokens and chat template."""
    info: dict[str, Any] = {"tokenizer_class": type(tokenizer).__name__}
    for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
        value = getattr(tokenizer, key, None)
        info[key] = value if isinstance(value, str) or value is None else str(value)
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, str):
        info["chat_template"] = template
    return info


def build_tokenize_router(ctx: Any, api_auth) -> APIRouter:
    """The two routes over the served model's tokenizer (`ctx`: the routes' ServeContext)."""
    router = APIRouter(dependencies=[Depends(api_auth)])

    @router.post("/tokenize")
    async def tokenize(req: TokenizeRequest) -> dict[str, Any]:
        _check_tokenize(ctx, req)
        tokens = await asyncio.to_thread(_tokens, ctx, req)
        strs = (
            await asyncio.to_thread(ctx.tokenizer.convert_ids_to_tokens, tokens)
            if req.return_token_strs
            else None
        )
        return {
            "count": len(tokens),
            "max_model_len": ctx.max_model_len,
            "tokens": tokens,
            "token_strs": strs,
        }

    @router.get("/tokenizer_info")
    async def tokenizer_info() -> dict[str, Any]:
        return _tokenizer_info(ctx.tokenizer)

    @router.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> dict[str, Any]:
        check_model(req.model, ctx.model_check)
        return {"prompt": await asyncio.to_thread(_detokenize, ctx, req)}

    return router


__all__ = ["DetokenizeRequest", "TokenizeRequest", "build_tokenize_router"]
