"""The agent endpoint: an OpenAI-compatible server over the run's engines, one session per episode.

It serves the server's own routes (`inflight.server`: `/v1/chat/completions` with tools and
streaming, `/v1/completions`, `/v1/responses`, `/v1/models`, `/tokenize`, `/detokenize`) from the
run's `InferenceClient`, whatever the engines are (in process, engine processes, Ray actors, HTTP
servers), on the trainer's own event loop (an in-process engine runs there), plus `GET
/weight_version` (the engines' weight version). Every request belongs to a session, named by its
token: as the API key (`Authorization: Bearer <token>`) or in the URL (`<url>/sessions/<token>/v1`,
the `base_url` agents get; both, when given, must agree); a request with no live session's token is
a 401. Each session's requests run in a `SessionScope` (`session.py`): the run's sampling, calls
recorded verbatim, prompts continued from the sampled tokens.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import socket
import time
import uuid
from collections.abc import Iterator
from typing import Any

import uvicorn
from fastapi import Depends, FastAPI, Request

from inflight.agents.session import Session, SessionBackend, SessionSampling, SessionScope
from inflight.chat.turns import PLAIN, ChatFormat
from inflight.server.errors import APIError, install_error_handlers
from inflight.server.openai_api import ServeContext, build_router
from inflight.server.responses_api import build_responses_router
from inflight.server.tokenize_api import build_tokenize_router

SESSION_PREFIX = "/sessions/"


class _QuietServer(uvicorn.Server):
    """uvicorn on the trainer's loop: the trainer keeps its own signal handling (Ctrl-C stops the run,
    which closes the endpoint)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class _SessionPath:
    """ASGI middleware: `/sessions/<token>/rest` is served as `/rest` with the token noted."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        path = scope.get("path", "")
        if scope["type"] == "http" and path.startswith(SESSION_PREFIX):
            token, _, rest = path[len(SESSION_PREFIX):].partition("/")
            scope = {**scope, "path": "/" + rest, "raw_path": ("/" + rest).encode(),
                     "state": {**scope.get("state", {}), "session_token": token}}
        await self.app(scope, receive, send)


class AgentEndpoint:
    """Sessions over `client`, served at `url` once `start()` ran on the caller's event loop.

    `served_model_name`: the name `/v1/models` lists and requests must use (None: any name is
    taken, listed as `model_name`). `max_model_len`: the engines' context. `fmt`: the run's chat
    template and arguments (a request's own win)."""

    def __init__(self, client: Any, tokenizer: Any, *, model_name: str, max_model_len: int,
                 served_model_name: str | None = None, fmt: ChatFormat = PLAIN, host: str = "127.0.0.1",
                 port: int = 0) -> None:
        self.client, self.tokenizer, self.fmt = client, tokenizer, fmt
        self.host, self.port = host, port
        self.sessions: dict[str, Session] = {}
        self.ctx = ServeContext(client, tokenizer, served_model_name or model_name, int(time.time()),
                                max_model_len=max_model_len, vocab_size=len(tokenizer),
                                any_model_name=served_model_name is None, scope_of=self._scope)
        self.app = self._app()
        self._server: _QuietServer | None = None
        self._task: asyncio.Task | None = None

    # ---- sessions ---------------------------------------------------------------------------------
    def open_session(self, sampling: SessionSampling) -> Session:
        """A new session (its token is a fresh secret)."""
        session = Session(uuid.uuid4().hex, secrets.token_urlsafe(24), sampling, self.fmt)
        self.sessions[session.token] = session
        return session

    def close_session(self, session: Session) -> None:
        """End a session: later requests with its token are refused, calls still running are not recorded."""
        session.closed = True
        self.sessions.pop(session.token, None)

    def base_url(self, session: Session) -> str:
        """The OpenAI base URL of a session (its token in the path)."""
        return f"{self.url}{SESSION_PREFIX}{session.token}/v1"

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def _session(self, request: Request) -> Session:
        in_path = getattr(request.state, "session_token", None)
        header = request.headers.get("authorization", "")
        scheme, _, key = header.partition(" ")
        in_key = key.strip() if scheme.lower() == "bearer" and key.strip() else None
        if in_path is not None and in_key is not None and in_path != in_key and in_key in self.sessions:
            raise APIError(401, "the API key and the URL name different sessions", code="invalid_session")
        token = in_path or in_key
        session = self.sessions.get(token) if token else None
        if session is None:
            raise APIError(401, "no live session: use the base_url and api_key your agent was given for "
                           "this episode (the session ends when the agent returns)", code="invalid_session")
        return session

    def _scope(self, request: Request) -> SessionScope:
        return SessionScope(SessionBackend(self.client, self._session(request)), self.tokenizer)

    # ---- the app ----------------------------------------------------------------------------------
    def _app(self) -> Any:
        app = FastAPI(title="inflight agent endpoint", docs_url=None, redoc_url=None, openapi_url=None)
        install_error_handlers(app)

        async def auth(request: Request) -> None:
            self._session(request)

        for router in (build_router(self.ctx, auth, token_route=False), build_tokenize_router(self.ctx, auth),
                       build_responses_router(self.ctx, auth)):
            app.include_router(router)

        @app.get("/weight_version", dependencies=[Depends(auth)])
        async def weight_version() -> dict[str, int]:
            return {"weight_version": await self.client.weight_version()}

        return _SessionPath(app)

    # ---- serving ----------------------------------------------------------------------------------
    async def start(self, timeout_s: float = 30.0) -> AgentEndpoint:
        """Serve on this event loop (port 0: a free one)."""
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(self.app, log_level="warning", lifespan="off", timeout_graceful_shutdown=2,
                                timeout_keep_alive=30)
        self._server = _QuietServer(config)
        self._task = asyncio.create_task(
            self._server.serve(sockets=[sock]), name=f"agent-endpoint-{self.port}"
        )
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if self._task.done():
                self._task.result()  # re-raises why it stopped
                raise RuntimeError(f"the agent endpoint on {self.url} stopped during start-up")
            if time.monotonic() > deadline:
                await self.close()
                raise TimeoutError(f"the agent endpoint on {self.url} did not start within {timeout_s} s")
            await asyncio.sleep(0.01)
        return self

    async def close(self) -> None:
        """Stop serving (idempotent)."""
        if self._server is None or self._task is None:
            return
        self._server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            try:
                await asyncio.wait_for(asyncio.shield(self._task), 10)
            except TimeoutError:
                self._server.force_exit = True
                await self._task
        self._server = self._task = None
        for session in list(self.sessions.values()):
            self.close_session(session)


__all__ = ["SESSION_PREFIX", "AgentEndpoint"]
