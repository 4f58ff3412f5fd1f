"""ASGI middleware that caps request bodies: an oversize body is answered 413 before any route runs.

The body is read (counting bytes) before the app sees it and then replayed, so a chunked upload
without Content-Length is capped too; the weight-chunk route gets its own, larger limit.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from inflight.server.errors import error_body

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


async def _reject(send: Send, status: int, message: str, code: str) -> None:
    body = json.dumps(error_body(message, "invalid_request_error", None, code)).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"connection", b"close"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


class BodyLimitMiddleware:
    """Reject bodies over `max_body_bytes` (or the path's entry in `limits`) with 413."""

    def __init__(self, app: ASGIApp, max_body_bytes: int, limits: dict[str, int] | None = None) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.limits = limits or {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.limits.get(scope["path"], self.max_body_bytes)
        too_large = f"request body is larger than this route's limit of {limit} bytes"
        headers = dict(scope.get("headers") or [])
        declared = headers.get(b"content-length")
        if declared is not None:
            try:
                size = int(declared)
            except ValueError:
                await _reject(send, 400, f"invalid Content-Length header {declared!r}", "invalid_header")
                return
            if size > limit:
                await _reject(send, 413, too_large, "request_too_large")
                return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away before sending the body
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                await _reject(send, 413, too_large, "request_too_large")
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # afterwards: disconnect notifications from the server

        await self.app(scope, replay, send)
