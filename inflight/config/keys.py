"""The schema seen as dotted keys: which keys exist, their types, lenient coercion and strict checks."""

from __future__ import annotations

import dataclasses
import difflib
import functools
import types
import typing
from typing import Any

from inflight.config.schema import Config
from inflight.config.status import field_choices

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


@functools.cache
def schema_fields(cls: type = Config) -> dict[str, dataclasses.Field]:
    """{leaf dotted key: its dataclass field} (the field's metadata holds the key's status)."""
    out: dict[str, dataclasses.Field] = {}

    def walk(c: type, prefix: str) -> None:
        hints = typing.get_type_hints(c)
        for f in dataclasses.fields(c):
            if dataclasses.is_dataclass(hints[f.name]):
                walk(hints[f.name], prefix + f.name + ".")
            else:
                out[prefix + f.name] = f

    walk(cls, "")
    return out


def schema_choices(cls: type = Config) -> dict[str, tuple[tuple[str, ...], dict[str, str]]]:
    """{dotted key: (allowed values, aliases)} of the string keys whose field declares its choices
    (`choices=` / `aliases=` of `inflight.config.status.skyrl`); validation refuses other values."""
    return {k: c for k, f in schema_fields(cls).items() if (c := field_choices(f)) is not None}


@functools.cache
def default_config() -> Config:
    """`Config()`, made once (read only: the defaults of every key)."""
    return Config()


def get_key(obj: Any, key: str) -> Any:
    """`get_key(cfg, "trainer.placement.colocate_all")`."""
    for part in key.split("."):
        obj = getattr(obj, part)
    return obj


def type_name(tp: Any) -> str:
    """Readable name of a schema type: `int`, `list[float]`, `str or null`, `mapping`."""
    args = typing.get_args(tp)
    if _is_optional(tp):
        inner = [a for a in args if a is not type(None)]
        return " or ".join(type_name(a) for a in inner) + " or null"
    if _is_union(tp):
        return " or ".join(type_name(a) for a in args)
    if typing.get_origin(tp) is list:
        return f"list[{type_name(args[0])}]"
    if is_mapping(tp):
        return "mapping"
    return getattr(tp, "__name__", str(tp))


def _is_union(tp: Any) -> bool:
    return typing.get_origin(tp) in (typing.Union, types.UnionType)


def _is_optional(tp: Any) -> bool:
    return _is_union(tp) and type(None) in typing.get_args(tp)


def _optional_inner(tp: Any) -> Any:
    """`X | None` -> X; `X | Y | None` -> `X | Y`."""
    inner = tuple(a for a in typing.get_args(tp) if a is not type(None))
    return inner[0] if len(inner) == 1 else typing.Union[inner]  # noqa: UP007 - a runtime union of types


def is_mapping(tp: Any) -> bool:
    """Whether a schema type is a mapping (`dict[str, Any]`, optionally `| None`)."""
    if _is_optional(tp):
        return is_mapping(_optional_inner(tp))
    return tp is dict or typing.get_origin(tp) is dict


def is_instance(value: Any, tp: Any) -> bool:
    """Strict check used by `validate`: bools are not ints, ints are fine where floats are expected."""
    if _is_optional(tp):
        return value is None or is_instance(value, _optional_inner(tp))
    if _is_union(tp):
        return any(is_instance(value, a) for a in typing.get_args(tp))
    if is_mapping(tp):
        return isinstance(value, dict) and all(isinstance(k, str) for k in value)
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
        return coerce(value, _optional_inner(tp))
    if _is_union(tp):  # e.g. bool | int: the first member that takes the value as it is, else converts it
        members = typing.get_args(tp)
        for member in members:
            if is_instance(value, member):
                return value
        for member in members:
            converted = coerce(value, member)
            if is_instance(converted, member):
                return converted
        return value
    if is_mapping(tp):
        return dict(value) if isinstance(value, dict) else value
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
    """Closest known dotted key to an unknown one, or None when nothing is close: a near spelling of
    the whole key (`trainer.fully_async.enable`), else the same last name in another section
    (`trainer.lr`, `generator.gpu_memory_utilization`), else the best near spelling of both."""
    known = list(known)
    leaf = key.rsplit(".", 1)[-1]

    def whole(candidate: str) -> float:
        return difflib.SequenceMatcher(None, key, candidate).ratio()

    def last(candidate: str) -> float:
        return difflib.SequenceMatcher(None, leaf, candidate.rsplit(".", 1)[-1]).ratio()

    near = [k for k in known if whole(k) >= 0.9]
    if near:
        return max(near, key=whole)
    same_leaf = [k for k in known if k.rsplit(".", 1)[-1] == leaf]
    if same_leaf:
        return max(same_leaf, key=whole)
    scored = [(whole(k) + 0.1 * last(k) + (0.1 if k.startswith(key) else 0.0), k) for k in known
              if last(k) >= 0.5 or whole(k) >= 0.85]
    best = max(scored, default=None)
    return best[1] if best is not None and best[0] >= 0.7 else None
