"""Version-salting vLLM's own OpenAI routes: an ASGI middleware that rewrites the JSON body of
`/v1/completions`, `/v1/chat/completions` and `/v1/responses` so that `cache_salt` carries the
weight version (the request's own salt kept after it), as the token route does. vLLM's prefix
cache is version-blind; with this a request that starts after an update never reuses KV of older
weights.
(Per-token weight versions are not given on these routes: use the token route.)"""

from __future__ import annotations

import json
from typing import Any

from .generate import salt_for
from .state import Lifecycle

SALTED_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/responses")


class VersionSaltMiddleware:
    """Rewrite `cache_salt` in the bodies of the OpenAI generation routes (others pass untouched)."""

    def __init__(self, app: Any, life: Lifecycle) -> None:
        self.app, self.life = app, life

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in SALTED_PATHS:
            return await self.app(scope, receive, send)
        chunks = []
        while True:
            message = await receive()
            chunks.append(message.get("body", b""))
            if message["type"] != "http.request" or not message.get("more_body"):
                break
        body = _salted(b"".join(chunks), self.life.weight_version)
        headers = [(k, v) for k, v in scope["headers"] if k != b"content-length"]
        scope = {**scope, "headers": [*headers, (b"content-length", str(len(body)).encode())]}
        sent = False

        async def replay() -> dict:
            nonlocal sent
            if sent:
                return await receive()
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)


def _salted(body: bytes, version: int) -> bytes:
    """The body with `cache_salt` set for `version`; a body that is not a JSON object is left as it
    is (vLLM answers it with its own 400)."""
    try:
        data = json.loads(body)
    except ValueError:
        return body
    if not isinstance(data, dict):
        return body
    salt = data.get("cache_salt")
    data["cache_salt"] = salt_for(version, salt if isinstance(salt, str) else None)
    return json.dumps(data).encode()
