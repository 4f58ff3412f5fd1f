"""The schema seen as dotted keys: which keys exist, their types, lenient coercion and strict checks."""

from __future__ import annotations

import dataclasses
import difflib
import functools
import types
import typing
from typing import Any

from inflight.config.schema import Config

_TRUE = {"true", "yes", "on"}
_FALSE = {"false", "no", "off"}
_NULL = {"null", "none", "~"}


@functools.cache
def schema_keys(cls: type = Config) -> tuple[dict[str, Any], frozenset[str]]:
    """Returns ({leaf dotted key: type}, {section dotted keys}) of a dataclass schema."""
    leaves: dict[str, Any] = {}
    sections: set[str] = set()

    def walk(c: type, prefix: str) -> None:
        hints = typing.get_type_hints(c)
        for f in dataclasses.fields(c):
            key, tp = prefix + f.name, hints[f.name]
            if dataclasses.is_dataclass(tp):
                sections.add(key)
                walk(tp, key + ".")
            else:
                leaves[key] = tp

    walk(cls, "")
    return leaves, frozenset(sections)


def get_key(obj: Any, key: str) -> Any:
    """`get_key(cfg, "trainer.placement.colocate_all")`."""
    for part in key.split("."):
        obj = getattr(obj, part)
    return obj


def type_name(tp: Any) -> str:
    """Readable name of a schema type: `int`, `list[float]`, `str or null`."""
    args = typing.get_args(tp)
    if _is_optional(tp):
        inner = next(a for a in args if a is not type(None))
        return f"{type_name(inner)} or null"
    if typing.get_origin(tp) is list:
        return f"list[{type_name(args[0])}]"
    return getattr(tp, "__name__", str(tp))


def _is_optional(tp: Any) -> bool:
    return typing.get_origin(tp) in (typing.Union, types.UnionType) and type(None) in typing.get_args(tp)


def is_instance(value: Any, tp: Any) -> bool:
    """Strict check used by `validate`: bools are not ints, ints are fine where floats are expected."""
    if _is_optional(tp):
        return value is None or is_instance(
            value, next(a for a in typing.get_args(tp) if a is not type(None))
        )
    if typing.get_origin(tp) is list:
        (elem,) = typing.get_args(tp)
        return isinstance(value, list) and all(is_instance(v, elem) for v in value)
    if tp is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, tp)


def coerce(value: Any, tp: Any) -> Any:
    """Lenient conversion used by the loader (strings from YAML or the command line).

    Returns the converted value, or `value` unchanged when it does not convert (validate then
    reports the type error): "1e-6" -> 1e-6 for floats, "8" -> 8 for ints, "yes"/"off" for bools,
    "null"/"None" for optional fields, tuples to lists.
    """
    if _is_optional(tp):
        if value is None or (isinstance(value, str) and value.strip().lower() in _NULL):
            return None
        return coerce(value, next(a for a in typing.get_args(tp) if a is not type(None)))
    if typing.get_origin(tp) is list:
        (elem,) = typing.get_args(tp)
        if isinstance(value, list | tuple):
            return [coerce(v, elem) for v in value]
        return value
    if not isinstance(value, str) or tp is str:
        return float(value) if tp is float and is_instance(value, float) else value
    text = value.strip()
    try:
        if tp is bool and text.lower() in _TRUE | _FALSE:
            return text.lower() in _TRUE
        if tp is int:
            return int(text)
        if tp is float:
            return float(text)
    except ValueError:
        pass
    return value


def suggest(key: str, known: typing.Iterable[str]) -> str | None:
    """Closest known dotted key to an unknown one: same leaf name elsewhere, else a near spelling."""
    known = list(known)
    leaf = key.rsplit(".", 1)[-1]
    same_leaf = [k for k in known if k.rsplit(".", 1)[-1] == leaf]
    if same_leaf:
        return max(same_leaf, key=lambda k: difflib.SequenceMatcher(None, key, k).ratio())
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    if close:
        return close[0]
    by_leaf = {k.rsplit(".", 1)[-1]: k for k in known}
    close = difflib.get_close_matches(leaf, list(by_leaf), n=1, cutoff=0.75)
    return by_leaf[close[0]] if close else None
