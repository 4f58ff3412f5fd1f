"""`POST /v1/responses`: the OpenAI Responses API over the chat path.

The body becomes the chat request it stands for (`responses_input.py`), which the chat path checks
(`validation.check_chat`, the tools), renders through the chat template in a thread (`chat_prompt`)
and generates as one engine request (`openai_api.engine_calls`); the result is rendered as a
Responses object or its events (`responses_output.py`). A chat error's field is named as the
Responses body names it (`input`, `max_output_tokens`).
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from inflight.server.backend import CallScope
from inflight.server.choices import whole_delta
from inflight.server.errors import APIError
from inflight.server.generation import finish_calls
from inflight.server.logprobs import TokenNamer
from inflight.server.openai_api import ServeContext, engine_calls, start_engine_calls
from inflight.server.protocol import ChatCompletionRequest
from inflight.server.responses_input import ResponsesRequest, responses_param, to_chat_request
from inflight.server.responses_output import ResponseRenderer
from inflight.server.validation import Checked, check_chat, check_chat_template


def _renamed(err: APIError) -> APIError:
    """A chat error as the Responses body names its field (also where the message opens with `field=`)."""
    chat_name, err.param = err.param, responses_param(err.param)
    if chat_name and err.param != chat_name and err.message.startswith(f"{chat_name}="):
        err.message = err.message.replace(chat_name, err.param)
    return err


def _checked(ctx: ServeContext, req: ResponsesRequest) -> tuple[ChatCompletionRequest, Checked]:
    chat = to_chat_request(req)
    checked = check_chat(chat, ctx.model_check, ctx.max_model_len)
    check_chat_template(chat.chat_template, ctx.trust_request_chat_template)
    return chat, checked


def _prompt(ctx: ServeContext, scope: CallScope, chat: ChatCompletionRequest) -> list[int]:
    try:
        return scope.chat_prompt(ctx.tokenizer, chat)
    except APIError as err:
        raise _renamed(err) from err


def build_responses_router(ctx: ServeContext, api_auth) -> APIRouter:
    router = APIRouter(dependencies=[Depends(api_auth)])

    @router.post("/v1/responses")
    async def responses(req: ResponsesRequest, request: Request) -> Response:
        try:
            chat, checked = _checked(ctx, req)
        except APIError as err:
            raise _renamed(err) from err
        scope = ctx.scope(request)
        prompt = await asyncio.to_thread(_prompt, ctx, scope, chat)  # templating and tokenizing: off the loop
        calls = engine_calls(ctx, checked, [prompt], "input")
        try:
            deltas = await start_engine_calls(scope, calls, req.stream, request, "input")
        except APIError as err:  # the engine's checks name the chat field (max_tokens)
            raise _renamed(err) from err
        renderer = ResponseRenderer(
            req,
            ctx.served_model_name,
            TokenNamer(ctx.tokenizer, chat.return_tokens_as_token_ids),
            checked.top_logprobs,
            checked.parse_tool_calls,
        )
        tracker = calls[0].tracker
        if req.stream:
            return StreamingResponse(renderer.events(deltas, tracker), media_type="text/event-stream")
        await finish_calls(deltas)
        body: dict[str, Any] = renderer.whole(tracker, whole_delta(tracker))
        return JSONResponse(body)

    return router


__all__ = ["build_responses_router"]
