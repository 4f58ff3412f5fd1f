"""OpenAI-compatible routes (`/v1/completions`, `/v1/chat/completions`, `/v1/models`) and the
token-in/token-out route `/inflight/v1/generate`.

Chat takes `tools` (see `tools.py`: rendered by the chat template, Hermes-format calls parsed out of
the output into `message.tool_calls` with `finish_reason="tool_calls"`, streamed as `tool_calls`
deltas). Logprobs carry the top-k alternatives (`logprobs.py`). Fields the engine does not
implement are refused by name (`unsupported.py`).

Each prompt and choice is one engine request; a call that spans a KEEP pause and a weight update
simply takes longer and returns one normal response (the tokens' weight versions are in
`token_weight_versions` when `return_token_ids` is set).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, StreamingResponse

from inflight.chat.tool_calls import parse_tool_calls
from inflight.engine.async_engine import AsyncEngine
from inflight.engine.errors import InvalidRequestError
from inflight.engine.request import SamplingParams
from inflight.server.chat_prompt import chat_prompt
from inflight.server.detokenize import ChoiceTracker, Delta
from inflight.server.errors import APIError, api_error_from, error_body
from inflight.server.generation import ACCEPTED, ClientDisconnected, EngineCall, collect, run_calls
from inflight.server.logprobs import TokenNamer, chat_logprobs, completion_logprobs
from inflight.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
    OpenAIRequestBase,
)
from inflight.server.tool_stream import ToolCallStream
from inflight.server.tools import parses_tool_calls
from inflight.server.unsupported import check_fields

MAX_N = 128
MAX_LOGPROBS = 20
SSE_KEEPALIVE_S = 10.0  # a stream that produced nothing for this long (a paused engine) sends a comment


@dataclass
class ServeContext:
    """What the routes share: the engine, the tokenizer and the name the model is served under."""

    engine: AsyncEngine
    tokenizer: Any
    served_model_name: str
    created: int

    @property
    def max_model_len(self) -> int:
        return self.engine.engine.max_model_len


# ---- request → engine calls ---------------------------------------------------------------------
def _check_model(ctx: ServeContext, model: str | None) -> None:
    if model is not None and model != ctx.served_model_name:
        raise APIError(404, f"the model `{model}` does not exist; this server serves `{ctx.served_model_name}`",
                       param="model", code="model_not_found")


def _check_common(req: OpenAIRequestBase) -> None:
    if not 1 <= req.n <= MAX_N:
        raise APIError(400, f"n={req.n} must be between 1 and {MAX_N}", param="n", code="invalid_value")
    check_fields(req)
    if any(s == "" for s in _stops(req)):
        raise APIError(400, "stop strings must not be empty", param="stop", code="invalid_value")


def _stops(req: OpenAIRequestBase) -> list[str]:
    return [req.stop] if isinstance(req.stop, str) else list(req.stop or [])


def _params(req: OpenAIRequestBase, max_tokens: int | None, prompt_len: int, ctx: ServeContext, choice: int,
            top_logprobs: int) -> SamplingParams:
    if max_tokens is None:
        max_tokens = max(1, ctx.max_model_len - prompt_len)
    seed = req.seed + choice if req.seed is not None else None  # n choices must differ
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=0 if req.top_k in (None, -1) else req.top_k,
        seed=seed,
        logprobs=True,
        top_logprobs=top_logprobs,
        stop_token_ids=list(req.stop_token_ids or []),
        ignore_eos=req.ignore_eos,
    )
    try:
        params.validate()
    except InvalidRequestError as err:
        raise api_error_from(err) from err
    return params


def _check_length(ctx: ServeContext, prompt: list[int], param: str) -> None:
    if len(prompt) >= ctx.max_model_len:
        raise APIError(
            400, f"this model's maximum context length is {ctx.max_model_len} tokens, but the prompt has "
            f"{len(prompt)} tokens; at most {ctx.max_model_len - 1} leave room for one output token",
            param=param, code="context_length_exceeded",
        )


def _calls(ctx: ServeContext, req: OpenAIRequestBase, prompts: list[list[int]], max_tokens: int | None,
           param: str, incremental: bool, top_logprobs: int) -> list[EngineCall]:
    base = uuid.uuid4().hex
    calls = []
    for p_index, prompt in enumerate(prompts):
        _check_length(ctx, prompt, param)
        for c in range(req.n):
            index = p_index * req.n + c
            tracker = ChoiceTracker(index, ctx.tokenizer, prompt, _stops(req), req.skip_special_tokens,
                                    req.include_stop_str_in_output, incremental or bool(_stops(req)))
            params = _params(req, max_tokens, len(prompt), ctx, c, top_logprobs)
            calls.append(EngineCall(f"{base}-{index}", prompt, params, req.cache_salt, tracker))
    return calls


async def _start(ctx: ServeContext, calls: list[EngineCall], stream: bool, request: Request | None,
                 param: str) -> AsyncIterator[Delta]:
    """Add the engine requests; raises an APIError (and adds nothing) if the engine rejects one."""
    deltas = run_calls(ctx.engine, calls, stream, request.is_disconnected if request is not None else None)
    try:
        first = await anext(deltas)
    except InvalidRequestError as err:
        raise api_error_from(err, param="request_id" if "request id" in str(err) else param) from err
    assert first.index == ACCEPTED
    return deltas


# ---- responses ----------------------------------------------------------------------------------
def _whole(t: ChoiceTracker) -> Delta:
    """A finished choice as one delta."""
    return Delta(t.index, t.text, t.output_token_ids, t.logprobs, t.token_weight_versions, t.finish_reason,
                 t.top_logprobs)


def _assistant_message(text: str, parse_calls: bool) -> dict[str, Any]:
    """The response message: with tools, the Hermes-format calls go to `tool_calls` and the content is
    the text outside them (null when nothing is left, as OpenAI sends it)."""
    if parse_calls:
        content, calls = parse_tool_calls(text)
        if calls:
            return {"role": "assistant", "content": content or None, "tool_calls": [c.to_openai() for c in calls]}
    return {"role": "assistant", "content": text}


def _usage(calls: list[EngineCall], n: int) -> dict[str, Any]:
    prompt = sum(len(c.prompt_token_ids) for c in calls[::n])
    completion = sum(len(c.tracker.output_token_ids) for c in calls)
    cached = sum(c.tracker.num_cached_tokens for c in calls[::n])
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _extension(tracker: ChoiceTracker | Delta, full: bool) -> dict[str, Any]:
    if full:
        assert isinstance(tracker, ChoiceTracker)
        return {"token_ids": tracker.output_token_ids, "token_weight_versions": tracker.token_weight_versions}
    return {"token_ids": tracker.token_ids, "token_weight_versions": tracker.token_weight_versions}


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


async def _with_keepalive(deltas: AsyncIterator[Delta]) -> AsyncIterator[Delta | None]:
    """The deltas, with a None whenever SSE_KEEPALIVE_S pass without one (e.g. during a pause)."""
    queue: asyncio.Queue[Any] = asyncio.Queue()
    end = object()

    async def pump() -> None:
        try:
            async for delta in deltas:
                queue.put_nowait(delta)
            queue.put_nowait(end)
        except Exception as err:
            queue.put_nowait(err)

    task = asyncio.ensure_future(pump())
    try:
        while True:
            try:
                async with asyncio.timeout(SSE_KEEPALIVE_S):
                    item = await queue.get()
            except TimeoutError:
                yield None
                continue
            if item is end:
                return
            if isinstance(item, Exception):
                raise item
            yield item
    finally:
        task.cancel()  # a consumer that left: the engine requests are aborted
        await asyncio.gather(task, return_exceptions=True)


async def _sse_stream(deltas: AsyncIterator[Delta], chunk, first_chunks: list[dict[str, Any]],
                      usage_chunk) -> AsyncIterator[str]:
    try:
        for payload in first_chunks:
            yield _sse(payload)
        async for delta in _with_keepalive(deltas):
            if delta is None:  # an SSE comment: clients ignore it; proxies and idle timeouts see traffic,
                yield ": keep-alive\n\n"  # and a client that went away is noticed during a pause
                continue
            payload = chunk(delta)
            if payload is not None:
                yield _sse(payload)
        if usage_chunk is not None:
            yield _sse(usage_chunk())
    except Exception as err:  # the status line is gone: report in the stream, as OpenAI does
        api_err = api_error_from(err)
        yield _sse(error_body(api_err.message, api_err.type, api_err.param, api_err.code))
    finally:
        await deltas.aclose()
    yield "data: [DONE]\n\n"


async def _finish_non_streaming(deltas: AsyncIterator[Delta]) -> None:
    try:
        await collect(deltas)
    except ClientDisconnected as err:
        raise APIError(499, "client disconnected", code="client_disconnected") from err


# ---- routes -------------------------------------------------------------------------------------
def build_router(ctx: ServeContext, api_auth) -> APIRouter:
    router = APIRouter(dependencies=[Depends(api_auth)])

    @router.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{
            "id": ctx.served_model_name, "object": "model", "created": ctx.created, "owned_by": "inflight",
            "max_model_len": ctx.max_model_len, "root": ctx.served_model_name,
        }]}

    @router.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        _check_model(ctx, req.model)
        _check_common(req)
        if req.best_of is not None and req.best_of != req.n:
            raise APIError(400, "best_of is not supported by this server (leave it unset or equal to n)",
                           param="best_of", code="unsupported_parameter")
        if req.logprobs is not None and not 0 <= req.logprobs <= MAX_LOGPROBS:
            raise APIError(400, f"logprobs={req.logprobs} must be between 0 and {MAX_LOGPROBS}",
                           param="logprobs", code="invalid_value")
        k = req.logprobs
        prompts = _completion_prompts(ctx, req.prompt)
        calls = _calls(ctx, req, prompts, req.max_tokens, "prompt", incremental=req.stream, top_logprobs=k or 0)
        deltas = await _start(ctx, calls, req.stream, None if req.stream else request, "prompt")
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        head = {"id": rid, "object": "text_completion", "created": created, "model": ctx.served_model_name}
        name = TokenNamer(ctx.tokenizer, req.return_tokens_as_token_ids)
        if req.stream:
            offsets = [0] * len(calls)

            def chunk(delta: Delta) -> dict[str, Any] | None:
                if not (delta.text or delta.finish_reason or req.return_token_ids or k is not None):
                    return None
                lp = completion_logprobs(name, delta, k, offsets[delta.index]) if k is not None else None
                offsets[delta.index] += len(delta.text)
                choice = {"index": delta.index, "text": delta.text, "logprobs": lp,
                          "finish_reason": delta.finish_reason}
                if req.return_token_ids:
                    choice.update(_extension(delta, full=False))
                return {**head, "choices": [choice]}

            include_usage = req.stream_options is not None and req.stream_options.include_usage
            usage = (lambda: {**head, "choices": [], "usage": _usage(calls, req.n)}) if include_usage else None
            return StreamingResponse(_sse_stream(deltas, chunk, [], usage), media_type="text/event-stream")
        await _finish_non_streaming(deltas)
        choices = []
        for call in calls:
            t = call.tracker
            choice = {"index": t.index, "text": t.text, "finish_reason": t.finish_reason,
                      "logprobs": completion_logprobs(name, _whole(t), k, 0) if k is not None else None}
            if req.return_token_ids:
                choice.update(_extension(t, full=True))
            choices.append(choice)
        body = {**head, "choices": choices, "usage": _usage(calls, req.n)}
        if req.return_token_ids:
            body["prompt_token_ids"] = prompts[0] if len(prompts) == 1 else prompts
        return JSONResponse(body)

    @router.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        _check_model(ctx, req.model)
        _check_common(req)
        parse_calls = parses_tool_calls(req)
        if req.top_logprobs is not None and not 0 <= req.top_logprobs <= MAX_LOGPROBS:
            raise APIError(400, f"top_logprobs={req.top_logprobs} must be between 0 and {MAX_LOGPROBS}",
                           param="top_logprobs", code="invalid_value")
        if req.top_logprobs and not req.logprobs:
            raise APIError(400, "top_logprobs requires logprobs=true", param="top_logprobs", code="invalid_value")
        k = (req.top_logprobs or 0) if req.logprobs else 0
        prompt = chat_prompt(ctx.tokenizer, req)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        calls = _calls(ctx, req, [prompt], max_tokens, "messages", incremental=req.stream, top_logprobs=k)
        deltas = await _start(ctx, calls, req.stream, None if req.stream else request, "messages")
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        name = TokenNamer(ctx.tokenizer, req.return_tokens_as_token_ids)
        if req.stream:
            head = {"id": rid, "object": "chat.completion.chunk", "created": created,
                    "model": ctx.served_model_name}
            tool_streams = {c.tracker.index: ToolCallStream() for c in calls} if parse_calls else {}

            def chunk(delta: Delta) -> dict[str, Any] | None:
                text, tool_calls, finish = delta.text, [], delta.finish_reason
                if parse_calls:
                    stream = tool_streams[delta.index]
                    text, tool_calls = stream.feed(delta.text, final=finish is not None)
                    if finish is not None and stream.calls:
                        finish = "tool_calls"
                if not (text or tool_calls or finish or req.return_token_ids or req.logprobs):
                    return None
                message: dict[str, Any] = {"content": text} if text else {}
                if tool_calls:
                    message["tool_calls"] = tool_calls
                choice = {"index": delta.index, "delta": message,
                          "logprobs": chat_logprobs(name, delta, k) if req.logprobs else None,
                          "finish_reason": finish}
                if req.return_token_ids:
                    choice.update(_extension(delta, full=False))
                return {**head, "choices": [choice]}

            first = [{**head, "choices": [{"index": c.tracker.index, "delta": {"role": "assistant", "content": ""},
                                           "logprobs": None, "finish_reason": None}]} for c in calls]
            include_usage = req.stream_options is not None and req.stream_options.include_usage
            usage = (lambda: {**head, "choices": [], "usage": _usage(calls, req.n)}) if include_usage else None
            return StreamingResponse(_sse_stream(deltas, chunk, first, usage), media_type="text/event-stream")
        await _finish_non_streaming(deltas)
        choices = []
        for call in calls:
            t = call.tracker
            message, finish = _assistant_message(t.text, parse_calls), t.finish_reason
            if "tool_calls" in message:
                finish = "tool_calls"
            choice = {"index": t.index, "message": message,
                      "logprobs": chat_logprobs(name, _whole(t), k) if req.logprobs else None,
                      "finish_reason": finish}
            if req.return_token_ids:
                choice.update(_extension(t, full=True))
            choices.append(choice)
        body = {"id": rid, "object": "chat.completion", "created": created, "model": ctx.served_model_name,
                "choices": choices, "usage": _usage(calls, req.n)}
        if req.return_token_ids:
            body["prompt_token_ids"] = prompt
        return JSONResponse(body)

    @router.post("/inflight/v1/generate")
    async def generate(req: GenerateRequest, request: Request) -> dict[str, Any]:
        _check_model(ctx, req.model)
        _check_length(ctx, req.prompt_token_ids, "prompt_token_ids")
        params = SamplingParams(**req.sampling_params.model_dump())
        try:
            params.validate()
        except InvalidRequestError as err:
            raise api_error_from(err) from err
        request_id = req.request_id or uuid.uuid4().hex
        tracker = ChoiceTracker(0, ctx.tokenizer, req.prompt_token_ids, incremental=False, decode=False)
        call = EngineCall(request_id, list(req.prompt_token_ids), params, req.cache_salt, tracker)
        deltas = await _start(ctx, [call], False, request, "prompt_token_ids")
        await _finish_non_streaming(deltas)
        return {
            "request_id": request_id,
            "output_token_ids": tracker.output_token_ids,
            "logprobs": tracker.logprobs,
            "top_logprobs": tracker.top_logprobs,  # per token [[token_id, logprob], ...] when asked
            "token_weight_versions": tracker.token_weight_versions,
            "finish_reason": tracker.finish_reason,
            "num_cached_tokens": tracker.num_cached_tokens,
            "num_recomputed_tokens": tracker.num_recomputed_tokens,
            "weight_version": ctx.engine.weight_version,
        }

    return router


def _completion_prompts(ctx: ServeContext, prompt: Any) -> list[list[int]]:
    if isinstance(prompt, str):
        prompt = [prompt]
    if not prompt:
        raise APIError(400, "prompt is empty", param="prompt", code="invalid_value")
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    out = []
    for p in prompt:
        ids = ctx.tokenizer(p)["input_ids"] if isinstance(p, str) else list(p)
        if not ids:
            raise APIError(400, "a prompt is empty (no tokens)", param="prompt", code="invalid_value")
        out.append(list(ids))
    return out
