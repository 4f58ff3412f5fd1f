"""`inflight models get NAME | list`: the registry's models as checked Hugging Face directories."""

from __future__ import annotations

import argparse
import sys
import time

from inflight.models_hub.cache import cache_root
from inflight.models_hub.get import get_models
from inflight.models_hub.registry import DTYPES, MODELS, ModelError


def _parser(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__)
    sub = parser.add_subparsers(dest="action", required=True)
    get = sub.add_parser("get", help="install, dequantize and check a model (once; then cached)")
    get.add_argument("name", choices=sorted(MODELS))
    get.add_argument("--dtype", choices=[*DTYPES, "both"], default="both",
                     help="which directories to make (default: both)")
    get.add_argument("--cache", help="cache folder (default: $INFLIGHT_CACHE, else ~/.cache/inflight)")
    sub.add_parser("list", help="the models this command knows")
    return parser


def main(argv: list[str] | None = None, prog: str = "inflight models") -> int:
    """Print each directory's path on stdout (progress on stderr); 1 with a one-line error."""
    args = _parser(prog).parse_args(argv)
    if args.action == "list":
        for model in MODELS.values():
            print(f"{model.name}: {model.description}")
        return 0
    dtypes = DTYPES if args.dtype == "both" else (args.dtype,)
    started = time.perf_counter()
    try:
        dirs = get_models(args.name, dtypes, args.cache)
    except ModelError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    for dtype, path in dirs.items():
        print(f"{dtype}: {path}")
    print(f"({time.perf_counter() - started:.1f} s; cache {cache_root(args.cache)})", file=sys.stderr)
    return 0
