"""Where models and their packages live: one cache folder, shared by the CLI, the tests and examples.

`$INFLIGHT_CACHE` (default `~/.cache/inflight`) holds `packages/<model>/` (the pip --target folder of
the model's packages) and `models/<model>-<dtype>/` (the Hugging Face directories)."""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

from inflight.models_hub.registry import KnownModel

MANIFEST = "inflight-model.json"


def cache_root(cache: str | Path | None = None) -> Path:
    """`cache` if given, else `$INFLIGHT_CACHE`, else `~/.cache/inflight`."""
    if cache is not None:
        return Path(cache)
    return Path(os.environ.get("INFLIGHT_CACHE", Path.home() / ".cache" / "inflight"))


def packages_dir(model: KnownModel, root: Path) -> Path:
    """The pip --target folder of `model`'s packages."""
    return root / "packages" / model.name


def model_dir(model: KnownModel, dtype: str, root: Path) -> Path:
    """The Hugging Face directory of `model` in `dtype`."""
    return root / "models" / f"{model.name}-{dtype}"


@contextlib.contextmanager
def locked(model: KnownModel, root: Path) -> Iterator[None]:
    """Hold `model`'s lock in `root`: two processes getting the same model take turns, and the second
    finds the first one's result."""
    path = root / "locks" / f"{model.name}.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
