"""`python -m inflight.server` (and `inflight serve`): load a model and serve it over HTTP."""

from __future__ import annotations

import argparse
import ipaddress
import os
import sys
from pathlib import Path

import torch
import uvicorn
from transformers import AutoTokenizer

from inflight.backends.registry import NATIVE, backend_entry, backend_names
from inflight.chat.images import DEFAULT_MAX_IMAGE_BYTES, DEFAULT_MAX_IMAGE_PIXELS, ImageLimits
from inflight.chat.vision import load_vision
from inflight.engine import AsyncEngine, EngineConfig, EngineError, LLMEngine
from inflight.engine.heap import frozen_heap
from inflight.server.app import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_WEIGHT_CHUNK_BYTES, create_app
from inflight.server.openai_api import DEFAULT_MAX_PROMPTS_PER_REQUEST


def build_parser(prog: str = "python -m inflight.server") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description="OpenAI-compatible inference server with "
                                     "in-flight weight updates (native paged-KV engine)")
    parser.add_argument("--backend", default=NATIVE.name, choices=backend_names(),
                        help="; ".join(f"{name}: {backend_entry(name).summary}" for name in backend_names()))
    parser.add_argument("--model", required=True, help="local Hugging Face model directory")
    parser.add_argument("--tokenizer", default=None, help="tokenizer directory (default: --model)")
    parser.add_argument("--served-model-name", default=None, help="model name in the API (default: dir name)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=os.environ.get("INFLIGHT_API_KEY"),
                        help="require this bearer key on the OpenAI routes (env INFLIGHT_API_KEY)")
    parser.add_argument("--control-token", default=os.environ.get("INFLIGHT_CONTROL_TOKEN"),
                        help="require this bearer token on the control routes (env INFLIGHT_CONTROL_TOKEN)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-kv-blocks", type=int, default=None)
    parser.add_argument("--kv-cache-memory-gib", type=float, default=1.0)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--weight-version", type=int, default=0, help="initial weight version")
    parser.add_argument("--max-body-bytes", type=int, default=None, help="cap on request bodies")
    parser.add_argument("--max-weight-chunk-bytes", type=int, default=None, help="cap on a weight chunk body")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--weight-update-timeout-s", type=float, default=300.0,
                        help="abandon a weight update that receives nothing for this long, restoring the old "
                             "weights (0: never)")
    parser.add_argument("--trust-request-chat-template", action="store_true",
                        help="let requests bring their own Jinja chat_template (code the server runs)")
    parser.add_argument("--max-image-pixels", type=int, default=DEFAULT_MAX_IMAGE_PIXELS,
                        help="vision-language models: most pixels (width x height) of one image; larger "
                             f"is a 400 (default {DEFAULT_MAX_IMAGE_PIXELS}; 0: no limit)")
    parser.add_argument("--max-image-bytes", type=int, default=DEFAULT_MAX_IMAGE_BYTES,
                        help=f"most bytes of one encoded image (default {DEFAULT_MAX_IMAGE_BYTES}; "
                             "0: no limit)")
    parser.add_argument("--allowed-local-media-path", default=None,
                        help="a folder whose image files requests may name (file:// URLs or paths); "
                             "none by default")
    parser.add_argument("--max-prompts-per-request", type=int, default=None,
                        help="most generations (prompts x n) one request may ask for (default 1024)")
    parser.add_argument("--log-level", default="info",
                        choices=["critical", "error", "warning", "info", "debug"])
    return parser


def image_limits(args: argparse.Namespace) -> ImageLimits:
    """The image limits of `--max-image-pixels`, `--max-image-bytes`, `--allowed-local-media-path`."""
    root = args.allowed_local_media_path
    if root is not None and not Path(root).is_dir():
        raise ValueError(f"--allowed-local-media-path {root!r} is not a folder")
    return ImageLimits(args.max_image_pixels or None, args.max_image_bytes or None,
                       Path(root).resolve() if root is not None else None)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def main(argv: list[str] | None = None, prog: str = "python -m inflight.server") -> int:
    """Parse `argv`, load the engine and serve until interrupted; returns the exit status. An
    external `--backend` gets the command line instead (its registry entry's `launch`: e.g. the
    process becomes vLLM's, `inflight.backends.vllm.launch`)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    backend = argparse.ArgumentParser(add_help=False)
    backend.add_argument("--backend", default=NATIVE.name, choices=backend_names())
    launch = backend_entry(backend.parse_known_args(argv)[0].backend).launcher()
    if launch is not None:
        return launch(argv)
    args = build_parser(prog).parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if not _is_loopback(args.host) and not args.control_token:
        print(f"warning: serving on {args.host} without --control-token: anyone who can reach it can pause "
              "the engine and replace its weights", file=sys.stderr)
    same = ("model", "device", "dtype", "block_size", "num_kv_blocks", "kv_cache_memory_gib", "max_num_seqs",
            "max_num_batched_tokens", "max_model_len", "seed", "weight_version")  # flag = EngineConfig field
    config = EngineConfig(**{name: getattr(args, name) for name in same},
                          enable_prefix_caching=not args.no_prefix_caching,
                          weight_update_timeout_s=args.weight_update_timeout_s or None)
    try:
        engine = LLMEngine(config)
        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or args.model)
        vision = load_vision(args.model, image_limits(args))
    except (EngineError, OSError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    app = create_app(
        AsyncEngine(engine), tokenizer, args.served_model_name or Path(args.model).resolve().name,
        api_key=args.api_key, control_token=args.control_token,
        max_body_bytes=args.max_body_bytes or DEFAULT_MAX_BODY_BYTES,
        max_weight_chunk_bytes=args.max_weight_chunk_bytes or DEFAULT_MAX_WEIGHT_CHUNK_BYTES,
        trust_request_chat_template=args.trust_request_chat_template,
        max_prompts_per_request=args.max_prompts_per_request or DEFAULT_MAX_PROMPTS_PER_REQUEST,
        vision=vision,
    )
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                           timeout_graceful_shutdown=5))
    with frozen_heap():
        server.run()
    return 0 if server.started else 1
