"""OpenAI-compatible inference server with control routes for in-flight weight updates.

`create_app(async_engine, tokenizer, served_model_name, ...)` builds the FastAPI app;
`main(argv)` is `python -m inflight.server` / `inflight serve`.
"""

from inflight.server.app import create_app
from inflight.server.launch import BackgroundServer
from inflight.server.main import main

__all__ = ["BackgroundServer", "create_app", "main"]
