"""OpenAI-compatible routes (`/v1/completions`, `/v1/chat/completions`, `/v1/models`) and the
token-in/token-out route `/inflight/v1/generate`; `engine_calls` and `start_engine_calls` also serve
`/v1/responses` (`responses_api.py`).

Both OpenAI routes take one path: validate once (`validation.py`), turn the prompts into one engine
request per prompt and choice, then answer whole or as SSE chunks, the choices rendered by the
route's kind (`choices.py`: text, or chat with tool calls). The engine computes logprobs only when
the request asks (completions `logprobs`, chat `logprobs`/`top_logprobs`); the token route always
returns them. Fields the engine does not implement are refused by name (`unsupported.py`).

A call that spans a KEEP pause and a weight update simply takes longer and returns one normal
response (the tokens' weight versions are in `token_weight_versions` when `return_token_ids` is set).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from inflight.chat.vision import Vision
from inflight.client import wire
from inflight.engine.errors import InvalidRequestError
from inflight.engine.request import SamplingParams
from inflight.engine.routing import encode_routed_experts
from inflight.server.backend import Backend, CallScope
from inflight.server.choices import ChatChoices, Choices, TextChoices, whole_delta
from inflight.server.detokenize import ChoiceTracker, Delta
from inflight.server.errors import APIError, api_error_from, error_body
from inflight.server.generation import EngineCall, finish_calls, start_calls, ticking
from inflight.server.logprobs import TokenNamer
from inflight.server.protocol import ChatCompletionRequest, CompletionRequest, GenerateRequest
from inflight.server.validation import Checked, check_chat, check_chat_template, check_completion, check_model

SSE_KEEPALIVE_S = 10.0  # a stream that produced nothing for this long (a paused engine) sends a comment
DEFAULT_MAX_PROMPTS_PER_REQUEST = 1024  # engine requests (prompts x n) one call may add


@dataclass
class ServeContext:
    """What the routes share: the engine, the tokenizer and the name the model is served under.

    `engine`: what generates (`backend.Backend`: an AsyncEngine, or any InferenceClient);
    `max_model_len` and `vocab_size` default to an AsyncEngine's own. `trust_request_chat_template`:
    whether a request may bring its own Jinja `chat_template` (off by default, as vLLM's
    `--trust-request-chat-template`: a template is code, and a few hundred bytes of nested loops
    render for seconds). `max_prompts_per_request`: the most engine requests (prompts x n) one call
    may add. `any_model_name`: requests may name any model (the agent endpoint, whose agents bring
    their own model strings); by default another name is a 404. `scope_of`: each request's
    `CallScope` (None: the engine, the chat template, no record). `vision`: a vision-language model's
    processor and image limits (`inflight.chat.vision.Vision`); None: text only, images are a 400."""

    engine: Backend
    tokenizer: Any
    served_model_name: str
    created: int
    trust_request_chat_template: bool = False
    max_prompts_per_request: int = DEFAULT_MAX_PROMPTS_PER_REQUEST
    max_model_len: int = 0
    vocab_size: int = 0
    any_model_name: bool = False
    scope_of: Callable[[Request], CallScope] | None = None
    vision: Vision | None = None
    _default_scope: CallScope | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        inner = getattr(self.engine, "engine", None)  # an AsyncEngine's LLMEngine
        self.max_model_len = self.max_model_len or inner.max_model_len
        self.vocab_size = self.vocab_size or inner.vocab_size
        self._default_scope = CallScope(self.engine, self.vision)

    def scope(self, request: Request) -> CallScope:
        """What `request` runs on."""
        return self.scope_of(request) if self.scope_of is not None else self._default_scope

    @property
    def model_check(self) -> str | None:
        """The model name requests must use (None: any)."""
        return None if self.any_model_name else self.served_model_name

    def model_card(self) -> dict[str, Any]:
        """The served model as `/v1/models` lists it."""
        return {
            "id": self.served_model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "inflight",
            "max_model_len": self.max_model_len,
            "root": self.served_model_name,
        }


# ---- request → engine calls ---------------------------------------------------------------------
def _check_length(ctx: ServeContext, prompt: list[int], param: str) -> None:
    if len(prompt) >= ctx.max_model_len:
        raise APIError(
            400, f"this model's maximum context length is {ctx.max_model_len} tokens, but the prompt has "
            f"{len(prompt)} tokens; at most {ctx.max_model_len - 1} leave room for one output token",
            param=param, code="context_length_exceeded",
        )


def engine_calls(ctx: ServeContext, checked: Checked, prompts: list[list[int]], param: str,
           prompt_texts: list[str] | None = None) -> list[EngineCall]:
    req, base, calls = checked.req, uuid.uuid4().hex, []
    if len(prompts) * req.n > ctx.max_prompts_per_request:
        raise APIError(400, f"{len(prompts)} prompts x n={req.n} is {len(prompts) * req.n} generations; this "
                       f"server takes at most {ctx.max_prompts_per_request} per request "
                       "(--max-prompts-per-request): split the request", param=param, code="invalid_value")
    for p_index, prompt in enumerate(prompts):
        _check_length(ctx, prompt, param)
        for c in range(req.n):
            index = p_index * req.n + c
            tracker = ChoiceTracker(index, ctx.tokenizer, prompt, checked.stops, req.skip_special_tokens,
                                    req.include_stop_str_in_output, req.stream or bool(checked.stops),
                                    stop_token_ids=list(req.stop_token_ids or []), ignore_eos=req.ignore_eos,
                                    keep_output=not checked.echo_only,
                                    prompt_text=prompt_texts[p_index] if prompt_texts else "")
            params = checked.params(len(prompt), ctx.max_model_len, c)
            calls.append(EngineCall(f"{base}-{index}", prompt, params, req.cache_salt, tracker,
                                    getattr(prompt, "multimodal", None)))  # chat_prompt.ImageIds
    return calls


async def start_engine_calls(scope: CallScope, calls: list[EngineCall], stream: bool, request: Request,
                             param: str) -> AsyncIterator[Delta]:
    """Add the engine requests to the scope's backend; raises an APIError (and adds nothing) if the
    engine rejects one. A whole response polls the connection while it waits (a stream notices when it
    writes). Once the deltas are all handed out, the scope hears that the calls finished."""
    try:
        deltas = await start_calls(scope.backend, calls, stream, None if stream else request.is_disconnected)
    except InvalidRequestError as err:
        raise api_error_from(err, param="request_id" if "request id" in str(err) else param) from err
    return _then(deltas, lambda: scope.finished(calls))


async def _then(deltas: AsyncIterator[Delta], done: Callable[[], None]) -> AsyncIterator[Delta]:
    """`deltas`, then `done()` once they ran out (not when they failed or were closed early)."""
    try:
        async for delta in deltas:
            yield delta
    finally:
        await deltas.aclose()
    done()


# ---- the one response path ----------------------------------------------------------------------
async def _respond(
    ctx: ServeContext,
    scope: CallScope,
    checked: Checked,
    prompts: list[list[int]],
    kind: Choices,
    request: Request,
    param: str,
    prompt_texts: list[str] | None = None,
) -> Response:
    """Run the request's engine calls and answer with `kind`'s choices: whole, or streamed."""
    req = checked.req
    calls = engine_calls(ctx, checked, prompts, param, prompt_texts)
    deltas = await start_engine_calls(scope, calls, req.stream, request, param)
    head = {"id": f"{kind.id_prefix}-{uuid.uuid4().hex}", "object": kind.object, "created": int(time.time()),
            "model": ctx.served_model_name}
    usage = lambda: _usage(calls, req.n)  # noqa: E731
    if req.stream:
        include_usage = req.stream_options is not None and req.stream_options.include_usage
        chunks = _chunks(
            deltas, kind, calls, {**head, "object": kind.chunk_object}, usage if include_usage else None
        )
        return StreamingResponse(chunks, media_type="text/event-stream")
    await finish_calls(deltas)
    choices = [kind.choice(whole_delta(c.tracker), True, c.tracker) for c in calls]
    trackers = [c.tracker for c in calls]
    return JSONResponse({**head, "choices": choices, "usage": usage(), **kind.whole_head(prompts, trackers)})


def _usage(calls: list[EngineCall], n: int) -> dict[str, Any]:
    prompt = sum(len(c.prompt_token_ids) for c in calls[::n])
    completion = sum(len(c.tracker.output_token_ids) for c in calls)
    cached = sum(c.tracker.num_cached_tokens for c in calls[::n])
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


async def _chunks(deltas: AsyncIterator[Delta], kind: Choices, calls: list[EngineCall], head: dict[str, Any],
                  usage: Callable[[], dict[str, Any]] | None) -> AsyncIterator[str]:
    """The SSE stream: openings, a chunk per delta that carries something, usage, then `[DONE]`."""
    try:
        for call in calls:
            if (opening := kind.opening(call.tracker.index)) is not None:
                yield _sse({**head, **kind.stream_head(call.tracker), "choices": [opening]})
        async with contextlib.aclosing(ticking(deltas, SSE_KEEPALIVE_S)) as items:
            async for delta in items:
                if delta is None:  # an SSE comment: clients ignore it; proxies and idle timeouts see traffic,
                    yield ": keep-alive\n\n"  # and a client that went away is noticed during a pause
                elif (choice := kind.choice(delta, False, calls[delta.index].tracker)) is not None:
                    yield _sse({**head, "choices": [choice]})
        if usage is not None:
            yield _sse({**head, "choices": [], "usage": usage()})
    except Exception as err:  # the status line is gone: report in the stream, as OpenAI does
        api_err = api_error_from(err)
        yield _sse(error_body(api_err.message, api_err.type, api_err.param, api_err.code))
    finally:
        await deltas.aclose()
    yield "data: [DONE]\n\n"


# ---- routes -------------------------------------------------------------------------------------
def build_router(ctx: ServeContext, api_auth, token_route: bool = True) -> APIRouter:
    """The OpenAI routes, and with `token_route` the token-in/token-out `/inflight/v1/generate`."""
    router = APIRouter(dependencies=[Depends(api_auth)])

    @router.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [ctx.model_card()]}

    @router.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        check_model(model_id, ctx.model_check)
        return ctx.model_card()

    @router.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request) -> Response:
        checked = check_completion(req, ctx.model_check, ctx.max_model_len)
        scope = ctx.scope(request)
        # tokenizing (and decoding a token prompt to echo it) never runs on the event loop
        prompts, texts = await asyncio.to_thread(_completion_prompts, ctx, scope, req.prompt, req.echo)
        kind = TextChoices(TokenNamer(ctx.tokenizer, req.return_tokens_as_token_ids), checked.top_logprobs,
                           req.return_token_ids, req.echo)
        return await _respond(ctx, scope, checked, prompts, kind, request, "prompt", texts)

    @router.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request) -> Response:
        checked = check_chat(req, ctx.model_check, ctx.max_model_len)
        check_chat_template(req.chat_template, ctx.trust_request_chat_template)
        scope = ctx.scope(request)
        # templating can be slow: off the loop
        prompt = await asyncio.to_thread(scope.chat_prompt, ctx.tokenizer, req)
        kind = ChatChoices(TokenNamer(ctx.tokenizer, req.return_tokens_as_token_ids), checked.top_logprobs,
                           req.return_token_ids, checked.parse_tool_calls)
        return await _respond(ctx, scope, checked, [prompt], kind, request, "messages")

    if token_route:
        _token_route(router, ctx)
    return router


def _token_route(router: APIRouter, ctx: ServeContext) -> None:
    @router.post("/inflight/v1/generate")
    async def generate(req: GenerateRequest, request: Request) -> dict[str, Any]:
        check_model(req.model, ctx.model_check)
        _check_length(ctx, req.prompt_token_ids, "prompt_token_ids")
        params = SamplingParams(**req.sampling_params.model_dump())  # checked by the engine as it admits it
        request_id = req.request_id or uuid.uuid4().hex
        tracker = ChoiceTracker(0, ctx.tokenizer, req.prompt_token_ids, incremental=False, decode=False)
        images = None
        if req.multimodal is not None:
            try:
                images = wire.decode_images(req.multimodal)
            except ValueError as err:
                raise APIError(400, str(err), param="multimodal", code="invalid_value") from None
        call = EngineCall(request_id, list(req.prompt_token_ids), params, req.cache_salt, tracker, images)
        await finish_calls(
            await start_engine_calls(ctx.scope(request), [call], False, request, "prompt_token_ids")
        )
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
            # MoE models: {"start", "shape", "dtype", "data" (base64)} (inflight.engine.routing), else None
            "routed_experts": encode_routed_experts(tracker.routed_experts, tracker.routed_experts_start),
            # sampling_params.prompt_logprobs set: per prompt token (None for the first), as the engine
            # gives them
            "prompt_logprobs": tracker.prompt_logprobs,
            "prompt_top_logprobs": tracker.prompt_top_logprobs,
            "prompt_logprob_ranks": tracker.prompt_logprob_ranks,
        }


def _completion_prompts(ctx: ServeContext, scope: CallScope, prompt: Any,
                        echo: bool) -> tuple[list[list[int]], list[str] | None]:
    """The prompts' token ids, and with `echo` their texts (as sent, or a token prompt decoded)."""
    if isinstance(prompt, str):
        prompt = [prompt]
    if not prompt:
        raise APIError(400, "prompt is empty", param="prompt", code="invalid_value")
    if all(isinstance(p, int) for p in prompt):
        prompt = [list(prompt)]
    out, texts = [], []
    for p in prompt:
        ids = scope.text_prompt(ctx.tokenizer, p) if isinstance(p, str) else list(p)
        if not ids:
            raise APIError(400, "a prompt is empty (no tokens)", param="prompt", code="invalid_value")
        out.append(list(ids))
        if echo:
            texts.append(p if isinstance(p, str) else _decode_prompt(ctx, p))
    return out, texts if echo else None


def _decode_prompt(ctx: ServeContext, ids: list[int]) -> str:
    try:
        return ctx.tokenizer.decode(ids, skip_special_tokens=False)
    except (OverflowError, IndexError, TypeError, ValueError) as err:  # ids outside the vocabulary
        raise APIError(400, f"prompt token ids cannot be decoded to echo them: {err}", param="prompt",
                       code="invalid_value") from err
