"""The object a `package.module:name` setting names (a user's reward, agent, estimator or loss)."""

from __future__ import annotations

import importlib
from typing import Any


def import_object(path: str, key: str, error: type[Exception] = ValueError) -> Any:
    """Import `path` (`package.module:name`, `name` may be dotted) for the setting `key`; raises
    `error` naming the key and what to fix when the path is malformed, the module cannot be imported
    or lacks the name."""
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise error(f"{key}={path!r}: write 'package.module:name'")
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as err:  # ImportError, or the module's own error at import time
        raise error(f"{key}={path!r}: cannot import module {module_name!r} "
                    f"({type(err).__name__}: {err}); is it on PYTHONPATH?") from err
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise error(f"{key}={path!r}: module {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return obj
