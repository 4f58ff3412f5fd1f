"""Run an app with uvicorn in a background thread (tests, benchmarks, notebooks)."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import uvicorn
from transformers import AutoTokenizer

from inflight.engine import AsyncEngine, LLMEngine
from inflight.server.app import create_app


class BackgroundServer:
    """Serve an ASGI app on `host` (127.0.0.1 by default) in a daemon thread.

    Port 0 picks a free port (the socket is bound before the thread starts, so there is no race).
    Use as a context manager, or call `start()` and `stop()`.
    """

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning") -> None:
        self.app, self.host, self.port = app, host, port
        config = uvicorn.Config(app, log_level=log_level, lifespan="on", timeout_graceful_shutdown=2,
                                timeout_keep_alive=30)
        self.server = uvicorn.Server(config)
        self._thread: threading.Thread | None = None
        self._sock: socket.socket | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout_s: float = 30.0) -> BackgroundServer:
        # IPPROTO_TCP explicitly: asyncio only sets TCP_NODELAY on such sockets (else +40 ms per answer)
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((self.host, self.port))
        self.port = self._sock.getsockname()[1]
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self._sock]},
                                        name=f"uvicorn-{self.port}", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self._thread.is_alive():
                raise RuntimeError(f"server on {self.url} exited during start-up")
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"server on {self.url} did not start within {timeout_s} s")
            time.sleep(0.01)
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        self.server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                self.server.force_exit = True
                self._thread.join(timeout_s)
            self._thread = None
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def serve_model(config, served_model_name: str | None = None, *, tokenizer=None, host: str = "127.0.0.1",
                port: int = 0, **app_kwargs) -> BackgroundServer:
    """Load `config` (an EngineConfig) into an AsyncEngine, serve it in a background thread and return
    the started server; `server.engine` is the AsyncEngine. `app_kwargs` go to `create_app`."""
    engine = AsyncEngine(LLMEngine(config))
    tokenizer = tokenizer or AutoTokenizer.from_pretrained(config.model)
    app = create_app(engine, tokenizer, served_model_name or Path(config.model).name, **app_kwargs)
    server = BackgroundServer(app, host, port)
    server.engine = engine
    return server.start()
