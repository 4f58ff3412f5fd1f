"""OpenAI-style error responses: `{"error": {"message", "type", "param", "code"}}` for every failure.

Engine errors map onto HTTP statuses (invalid input 400, wrong lifecycle state 409, bad weights 400
with code `weight_update_error`), a weight group's errors onto the status and code they carry;
anything unexpected is a 500 with the same body, and the server
keeps serving.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from inflight.engine.errors import EngineError, EngineStateError, InvalidRequestError, WeightUpdateError
from inflight.weight_sync.group import WeightGroupError

log = logging.getLogger("inflight.server")

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 405: "invalid_request_error", 409: "conflict_error",
          413: "invalid_request_error", 422: "invalid_request_error"}


class APIError(Exception):
    """An error to answer with `status` and an OpenAI-style body."""

    def __init__(self, status: int, message: str, *, type: str | None = None, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
        self.param = param
        self.code = code


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def error_response(err: APIError, extra: dict[str, Any] | None = None) -> JSONResponse:
    body = error_body(err.message, err.type, err.param, err.code)
    return JSONResponse({**(extra or {}), **body}, status_code=err.status)


_PARAM = re.compile(r"(?:invalid sampling parameters: )?(\w+)=")


def api_error_from(err: Exception, param: str | None = None) -> APIError:
    """Map an engine exception onto an APIError; `param` is the field when the message names none
    (the engine's sampling checks name theirs: `temperature=-1 must be ...`)."""
    if isinstance(err, APIError):
        return err
    if isinstance(err, WeightUpdateError):
        return APIError(400, str(err), code="weight_update_error")
    if isinstance(err, EngineStateError):
        return APIError(409, str(err), code="engine_state_error")
    if isinstance(err, WeightGroupError):  # it says its status and code (the broadcast-group routes)
        return APIError(err.status, str(err), param=err.param, code=err.code)
    if isinstance(err, InvalidRequestError | ValueError):
        if m := _PARAM.match(str(err)):
            param = m.group(1)
        return APIError(400, str(err), param=param, code="invalid_value")
    log.exception("unexpected server error", exc_info=err)
    return APIError(500, f"internal server error: {type(err).__name__}: {err}", code="internal_error")


def _validation_error(exc: RequestValidationError) -> APIError:
    errors = exc.errors()
    for e in errors:
        if e.get("type") == "json_invalid":
            detail = e.get("ctx", {}).get("error", "")
            return APIError(400, f"the request body is not valid JSON: {detail}".strip(), code="invalid_json")
        if tuple(e.get("loc", ())) == ("body",):
            if e.get("type") == "missing":
                return APIError(400, "the request body is missing; send a JSON object", code="invalid_json")
            return APIError(400, "the request body must be a JSON object (Content-Type: application/json)",
                            code="invalid_json")
    parts, params = [], []
    for e in errors[:5]:
        loc = [str(x) for x in e.get("loc", ()) if x not in ("body", "query")]
        params.append(".".join(loc) or None)
        parts.append(f"{'.'.join(loc) or 'body'}: {e.get('msg')}")
    return APIError(400, "invalid request: " + "; ".join(parts), param=params[0] if params else None,
                    code="invalid_value")


def install_error_handlers(app: FastAPI) -> None:
    """Answer every failure with an OpenAI-style error body."""

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(_validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return error_response(APIError(exc.status_code, str(exc.detail), code=code))

    # APIErrors and engine errors are expected answers: handled here, the connection stays open.
    # Anything else is a bug; the `Exception` handler still answers 500 with the same body.
    @app.exception_handler(APIError)
    @app.exception_handler(EngineError)
    @app.exception_handler(WeightGroupError)
    @app.exception_handler(ValueError)
    @app.exception_handler(Exception)
    async def _answer(_: Request, exc: Exception) -> JSONResponse:
        return error_response(api_error_from(exc))
