"""Importing the test oracles (SkyRL 0.3.0, verl 0.9.1) that scripts/bootstrap.sh installs, without
their dependencies, into .venv/oracles: a folder only tests put on sys.path. When one cannot be
imported the test fails, naming the fix; nothing is skipped."""

from __future__ import annotations

import importlib
import logging
import sys
import typing
from pathlib import Path
from types import ModuleType

import pytest

ORACLE_DIR = Path(sys.prefix) / "oracles"


def import_oracle(name: str) -> ModuleType:
    """The oracle module `name` from .venv/oracles."""
    if str(ORACLE_DIR) not in sys.path:
        sys.path.append(str(ORACLE_DIR))
    import typing_extensions

    # SkyRL 0.3.0 declares Python >= 3.11 but its Tinker types put a `typing.TypedDict` in a pydantic
    # model, which pydantic refuses before Python 3.12; its typing_extensions twin is accepted. Only
    # while SkyRL's modules import. verl's import calls logging.basicConfig: the root logger is restored.
    root = logging.getLogger()
    handlers, level, typed_dict = list(root.handlers), root.level, typing.TypedDict
    typing.TypedDict = typing_extensions.TypedDict
    try:
        return importlib.import_module(name)
    except Exception as err:  # ImportError, or the oracle's own error while importing
        pytest.fail(
            f"cannot import the test oracle {name} from {ORACLE_DIR} ({type(err).__name__}: {err}): "
            "run scripts/bootstrap.sh, which installs SkyRL and verl there",
            pytrace=False,
        )
    finally:
        typing.TypedDict = typed_dict
        root.handlers[:] = handlers
        root.setLevel(level)
