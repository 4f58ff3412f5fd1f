"""Errors raised by the clients. HTTP errors from a server map onto the engine's own error classes,
so a trainer catches `WeightUpdateError` (etc.) whether it holds a LocalClient or a RemoteClient."""

from __future__ import annotations

from typing import Any

from inflight.engine.errors import EngineError, EngineStateError, InvalidRequestError, WeightUpdateError


class ClientError(EngineError):
    """Base class of every error raised by a client."""


class ServerUnavailableError(ClientError, ConnectionError):
    """A server could not be reached, or died or stopped answering while a call was in flight."""

    def __init__(self, url: str, message: str, request_sent: bool = True) -> None:
        super().__init__(f"{url}: {message}")
        self.url = url
        self.request_sent = request_sent  # False: the server never got it (safe to send elsewhere)


class RemoteError(ClientError):
    """A server answered with an error status; `status`, `url` and the OpenAI-style `error` body."""

    def __init__(self, url: str, status: int, error: dict[str, Any]) -> None:
        self.url, self.status, self.error = url, status, error
        message = error.get("message") or f"HTTP {status}"
        super().__init__(f"{url}: HTTP {status}: {message}")

    @property
    def code(self) -> str | None:
        return self.error.get("code")


class RemoteInvalidRequestError(RemoteError, InvalidRequestError):
    """The server rejected the request's input (4xx)."""


class RemoteWeightUpdateError(RemoteError, WeightUpdateError):
    """The server rejected a weight update (unknown name, wrong shape, incomplete update)."""


class RemoteEngineStateError(RemoteError, EngineStateError):
    """The operation is not allowed in the server engine's current state (409)."""


class AuthenticationError(RemoteError):
    """Missing or wrong API key or control token (401/403)."""


class ServerError(RemoteError):
    """The server failed internally (5xx)."""


class FanOutError(ClientError):
    """A call fanned out to several servers failed on at least one of them; `errors` maps each
    failing URL to its exception (the other servers did complete the call)."""

    def __init__(self, what: str, errors: dict[str, BaseException], num_servers: int) -> None:
        self.errors = errors
        details = "; ".join(f"{url}: {type(err).__name__}: {err}" for url, err in errors.items())
        super().__init__(f"{what} failed on {len(errors)} of {num_servers} servers: {details}")


class InconsistentServersError(ClientError):
    """Servers that should agree (e.g. on the weight version) do not."""


def error_from_response(url: str, status: int, body: Any) -> RemoteError:
    """The exception for an error response (body: the parsed JSON, or anything else)."""
    error = body.get("error") if isinstance(body, dict) else None
    if not isinstance(error, dict):
        error = {"message": str(body)[:500] if body else f"HTTP {status}", "type": None, "code": None}
    code = error.get("code")
    if status in (401, 403):
        cls: type[RemoteError] = AuthenticationError
    elif status >= 500:
        cls = ServerError
    elif code == "weight_update_error":
        cls = RemoteWeightUpdateError
    elif status == 409 or code == "engine_state_error":
        cls = RemoteEngineStateError
    else:
        cls = RemoteInvalidRequestError
    return cls(url, status, error)
