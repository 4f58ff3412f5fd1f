"""The weight-sync protocol's own modules, loaded by path: `inflight/weight_sync/chunking.py` (chunk
metadata, the flat-buffer layout, `Reassembler`) and `group.py` (`GroupMember`, the broadcast
group's member side), as the private package `_inflight_weight_sync`.

vLLM's interpreter lacks the `inflight` package, and a second implementation of the group protocol
would drift from the trainer's (`GroupHost`). Those two files import only the standard library and
torch, and each other relatively; tests/backends/vllm fail when they start importing anything else.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path

WEIGHT_SYNC_DIR = Path(__file__).resolve().parents[2] / "weight_sync"
PACKAGE = "_inflight_weight_sync"
FILES = ("chunking", "group")  # in import order: group.py imports chunking.py


def load() -> types.ModuleType:
    """The package holding `FILES` as its modules (loaded once per interpreter)."""
    package = sys.modules.get(PACKAGE)
    if package is not None:
        return package
    package = types.ModuleType(PACKAGE, "inflight/weight_sync's chunking.py and group.py, loaded by path")
    package.__path__ = []  # a package whose only modules are the ones loaded below
    sys.modules[PACKAGE] = package
    try:
        for name in FILES:
            spec = importlib.util.spec_from_file_location(f"{PACKAGE}.{name}", WEIGHT_SYNC_DIR / f"{name}.py")
            assert spec is not None and spec.loader is not None
            module = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = module
            spec.loader.exec_module(module)
            setattr(package, name, module)
    except BaseException:
        for name in [PACKAGE, *(f"{PACKAGE}.{n}" for n in FILES)]:
            sys.modules.pop(name, None)
        raise
    return package


chunking = load().chunking
group = load().group
