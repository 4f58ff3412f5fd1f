"""A model's packages in their own pip --target folder, and its GGUF file checked in it."""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.machinery
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from inflight.models_hub.registry import InstallError, KnownModel, ModelError

STAMP = ".inflight-installed"


def _reinstall_hint(model: KnownModel, site: Path) -> str:
    return f"delete {site} and run `inflight models get {model.name}` again"


def install_packages(model: KnownModel, site: Path, say=print) -> Path:
    """pip-install `model.packages` without their dependencies into `site` (a --target folder that
    only this package puts on sys.path), unless a finished install of the same list is there."""
    wanted = " ".join(model.packages)
    stamp = site / STAMP
    if stamp.is_file() and stamp.read_text() == wanted:
        return site
    tmp = site.with_name(site.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    say(f"installing {wanted} into {site} (pip, from the package index) ...")
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-input",
           "--disable-pip-version-check", "--target", str(tmp), *model.packages]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        errors = [ln.strip() for ln in done.stderr.splitlines() if ln.strip().startswith("ERROR")]
        why = errors[-1] if errors else (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]
        raise InstallError(
            f"could not install {wanted} into {site} ({why}); the package index must be reachable "
            f"(pip's settings: pip config list), or install them there yourself: "
            f"{sys.executable} -m pip install --no-deps --target {site} {wanted}"
        )
    (tmp / STAMP).write_text(wanted)
    shutil.rmtree(site, ignore_errors=True)
    tmp.rename(site)
    return site


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def source_file(model: KnownModel, site: Path) -> Path:
    """The model's GGUF file in `site`, checked against the size and sha256 pinned in the registry."""
    path = site / model.module_dir / model.gguf_file
    if not path.is_file():
        raise ModelError(f"model file {path} is missing: {_reinstall_hint(model, site)}")
    size = path.stat().st_size
    if size != model.gguf_size:
        state = "truncated" if size < model.gguf_size else "larger than expected"
        raise ModelError(f"model file {path} is {state} ({size} of {model.gguf_size} bytes): "
                         f"{_reinstall_hint(model, site)}")
    if _sha256(path) != model.gguf_sha256:
        raise ModelError(f"model file {path} is corrupt (sha256 differs from {model.packages[0]}'s): "
                         f"{_reinstall_hint(model, site)}")
    return path


def require_gguf(model: KnownModel, site: Path) -> None:
    """The `gguf` package must be importable from `site` (transformers reads GGUF files with it)."""
    if importlib.machinery.PathFinder.find_spec("gguf", [str(site)]) is None:
        raise ModelError(f"the gguf package is not installed in {site} (transformers needs it to read the "
                         f"model file): {_reinstall_hint(model, site)}")


@contextlib.contextmanager
def on_path(site: Path) -> Iterator[None]:
    """`site` first on sys.path for the duration: transformers finds `gguf` there.

    transformers caches whether gguf is importable (`is_gguf_available` is an lru_cache): cleared on
    the way in and out so that its answer is the one for the path in force."""
    from transformers.utils import import_utils

    forget = getattr(import_utils.is_gguf_available, "cache_clear", lambda: None)
    sys.path.insert(0, str(site))
    importlib.invalidate_caches()
    forget()
    try:
        yield
    finally:
        sys.path.remove(str(site))
        forget()
