"""`create_app`: the FastAPI application around one AsyncEngine."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from typing import Any

from fastapi import FastAPI, Request

from inflight.chat.vision import Vision
from inflight.client import wire
from inflight.engine.async_engine import AsyncEngine
from inflight.server.control import build_control_router
from inflight.server.errors import APIError, install_error_handlers
from inflight.server.metrics import ServerMetrics
from inflight.server.middleware import BodyLimitMiddleware
from inflight.server.openai_api import DEFAULT_MAX_PROMPTS_PER_REQUEST, ServeContext, build_router
from inflight.server.responses_api import build_responses_router
from inflight.server.tokenize_api import build_tokenize_router
from inflight.weight_sync.receiver import engine_receiver

DEFAULT_MAX_BODY_BYTES = 16 * 2**20
DEFAULT_MAX_WEIGHT_CHUNK_BYTES = 4 * 2**30
GENERATION_ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/responses", wire.GENERATE)


def bearer_auth(token: str | None, what: str, wrong_status: int):
    """A dependency that requires `Authorization: Bearer <token>` (no-op when token is None)."""
    expected = token.encode() if token else None
    slug = what.lower().replace(" ", "_")

    async def check(request: Request) -> None:
        if expected is None:
            return
        header = request.headers.get("authorization")
        if not header:
            raise APIError(401, f"this route requires the {what}: send 'Authorization: Bearer <{what}>'",
                           code=f"missing_{slug}")
        scheme, _, value = header.partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(value.strip().encode(), expected):
            raise APIError(wrong_status, f"invalid {what}", code=f"invalid_{slug}")

    return check


class _HttpMetrics:
    """ASGI middleware counting answered requests by route and status (known routes only)."""

    def __init__(self, app, metrics: ServerMetrics, routes: set[str]) -> None:
        self.app, self.metrics, self.routes = app, metrics, routes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        route = scope["path"] if scope["path"] in self.routes else "unmatched"
        start = time.perf_counter()
        status = 500

        async def counting_send(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                if route in GENERATION_ROUTES and status < 400:
                    self.metrics.request_latency.labels(route).observe(time.perf_counter() - start)
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        finally:
            self.metrics.http_requests.labels(route, str(status)).inc()


def create_app(
    async_engine: AsyncEngine,
    tokenizer: Any,
    served_model_name: str,
    api_key: str | None = None,
    control_token: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    max_weight_chunk_bytes: int = DEFAULT_MAX_WEIGHT_CHUNK_BYTES,
    trust_request_chat_template: bool = False,
    max_prompts_per_request: int = DEFAULT_MAX_PROMPTS_PER_REQUEST,
    vision: Vision | None = None,
) -> FastAPI:
    """The inference server: OpenAI routes (API key), control routes (control token), /health and
    /metrics (open). Bodies over `max_body_bytes` (weight chunks: `max_weight_chunk_bytes`) get 413.
    `vision`: a vision-language model's processor and image limits (None: text only)."""
    metrics = ServerMetrics(async_engine)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        sampler = asyncio.create_task(metrics.run_sampler())
        try:
            yield
        finally:
            sampler.cancel()
            await asyncio.gather(sampler, return_exceptions=True)
            engine_receiver(async_engine).close()  # leave the broadcast group, if any
            await async_engine.close()

    app = FastAPI(title="inflight", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    ctx = ServeContext(async_engine, tokenizer, served_model_name, int(time.time()),
                       trust_request_chat_template, max_prompts_per_request, vision=vision)
    install_error_handlers(app)
    api_auth = bearer_auth(api_key, "API key", 401)
    routers = [
        build_router(ctx, api_auth),
        build_tokenize_router(ctx, api_auth),
        build_responses_router(ctx, api_auth),
        build_control_router(async_engine, bearer_auth(control_token, "control token", 403), metrics),
    ]
    for router in routers:
        app.include_router(router)
    routes = {getattr(r, "path", "") for router in routers for r in router.routes}
    app.add_middleware(BodyLimitMiddleware, max_body_bytes=max_body_bytes,
                       limits={wire.WEIGHTS_CHUNK: max_weight_chunk_bytes})
    app.add_middleware(_HttpMetrics, metrics=metrics, routes=routes)  # outermost: counts 413s too
    return app
