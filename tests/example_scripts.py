"""The recipes' scripts under examples/ (not a package), loaded as modules for the tests."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def load_example(recipe: str, script: str = "make_data.py") -> ModuleType:
    """`examples/<recipe>/<script>` as a module named `<recipe>_<script stem>`."""
    path = EXAMPLES / recipe / script
    spec = importlib.util.spec_from_file_location(f"{recipe}_{Path(script).stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
