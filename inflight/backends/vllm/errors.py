"""OpenAI-style error bodies, the same as the native server's (`inflight/server/errors.py`), so that
`inflight.client.errors.error_from_response` maps them onto the same exception classes."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 409: "conflict_error", 422: "invalid_request_error"}


class APIError(Exception):
    """An error to answer with `status` and an OpenAI-style body."""

    def __init__(
        self, status: int, message: str, *, code: str | None = None, param: str | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param


def weight_error(message: str, param: str | None = None) -> APIError:
    """A refused weight update (the client raises `WeightUpdateError`)."""
    return APIError(400, message, code="weight_update_error", param=param)


def state_error(message: str) -> APIError:
    """An operation the server's state does not allow (the client raises `EngineStateError`)."""
    return APIError(409, message, code="engine_state_error")


def error_response(err: APIError, extra: dict[str, Any] | None = None) -> JSONResponse:
    kind = _TYPES.get(err.status, "server_error" if err.status >= 500 else "invalid_request_error")
    body = {"error": {"message": err.message, "type": kind, "param": err.param, "code": err.code}}
    return JSONResponse({**(extra or {}), **body}, status_code=err.status)


def install_error_handlers(app: FastAPI) -> None:
    """Our routes' failures as OpenAI-style bodies (vLLM's own handlers, also OpenAI-style, stay for
    everything else: a malformed body on our routes is answered by vLLM's validation handler)."""

    @app.exception_handler(APIError)
    async def _api(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)
