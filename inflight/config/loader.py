"""YAML files and dotted command-line overrides -> a validated `Config`.

A file may nest keys (`trainer: {placement: {colocate_all: false}}`), write them dotted at any level
(`trainer.placement.colocate_all: false`), or mix both; later definitions win. Overrides are
`a.b.c=value` with the value read as YAML (`true`, `8`, `1e-6`, `[0.9, 0.95]`, `null`, `text`);
a leading `+` (Hydra's "add key") is accepted. SkyRL's older flat generator keys are read as the
new ones (`generator.num_inference_engines` -> `generator.inference_engine.num_engines`).
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from inflight.config.errors import ConfigError, Violation
from inflight.config.keys import coerce, is_mapping, schema_keys, suggest
from inflight.config.schema import Config
from inflight.config.validate import collect_violations

_IE = "generator.inference_engine."
KEY_ALIASES = {
    "generator.model_dtype": _IE + "model_dtype",
    _IE + "dtype": _IE + "model_dtype",
    "trainer.use_sample_packing": "trainer.remove_microbatch_padding",
    "generator.num_inference_engines": _IE + "num_engines",
    "generator.inference_engine_tensor_parallel_size": _IE + "tensor_parallel_size",
    "generator.weight_sync_backend": _IE + "weight_sync_backend",
    "generator.enable_prefix_caching": _IE + "enable_prefix_caching",
    "generator.enable_chunked_prefill": _IE + "enable_chunked_prefill",
    "generator.max_num_seqs": _IE + "max_num_seqs",
    "generator.max_num_batched_tokens": _IE + "max_num_batched_tokens",
}
"""Older names read as today's: SkyRL's flat generator layout and renamed keys, our `dtype`."""

REMOVED_KEYS = {
    _IE + "async_engine": (
        "SkyRL always runs the async engine path; `async_engine=true` is dropped as SkyRL drops it",
        True,
    ),
    _IE + "enable_http_endpoint": ("is no longer a SkyRL key: the engines always serve HTTP routes", None),
    _IE + "override_existing_update_group": (
        "is no longer a SkyRL key: weight-sync groups are managed by the run",
        None,
    ),
    _IE + "remote_urls": ("is no longer a SkyRL key", None),
}
"""Keys SkyRL removed: (why, the one value still accepted and dropped, or None: always refused)."""

ENGINE_INIT_KWARGS = _IE + "engine_init_kwargs"


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> Config:
    """Read a YAML file (or start from the defaults when `path` is None), apply `overrides`
    (`["trainer.fully_async.enabled=true", ...]`), and validate. Raises one `ConfigError` listing
    every unknown key, type error and broken rule."""
    data = read_yaml(path) if path is not None else {}
    return config_from_dict(data, overrides)


def config_from_dict(data: Mapping[str, Any], overrides: Sequence[str] = ()) -> Config:
    """Like `load_config`, from an already-parsed mapping (nested and/or dotted keys)."""
    problems: list[Violation] = []
    flat: dict[str, Any] = {}
    _flatten(data, "", flat, problems)
    for text in [overrides] if isinstance(overrides, str) else overrides:
        parsed = parse_override(text, problems)
        if parsed is not None:
            flat[KEY_ALIASES.get(parsed[0], parsed[0])] = parsed[1]
    cfg = _build(flat, problems)
    violations = problems + collect_violations(cfg)
    if violations:
        raise ConfigError(violations)
    return cfg


def read_yaml(path: str | Path) -> dict[str, Any]:
    """Parse a YAML file whose top level is a mapping (an empty file is `{}`)."""
    text = Path(path).read_text()
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(
            [Violation(str(path), None, f"is not valid YAML ({e})", "fix the YAML syntax")]
        ) from e
    if data is None:
        return {}
    if not isinstance(data, Mapping):
        raise ConfigError(
            [
                Violation(
                    str(path), data, "the top level must be a mapping of keys", "write `key: value` lines"
                )
            ]
        )
    return dict(data)


def parse_override(text: str, problems: list[Violation]) -> tuple[str, Any] | None:
    """`"a.b=1"` -> `("a.b", 1)`; a malformed override is recorded in `problems` and gives None."""
    body = text.strip().lstrip("+")
    key, sep, raw = body.partition("=")
    key = key.strip()
    if not sep or not key:
        problems.append(
            Violation(text, None, "an override must be `key=value`", "write e.g. trainer.epochs=2")
        )
        return None
    return key, parse_value(raw)


def parse_value(raw: str) -> Any:
    """Read an override's value as YAML; what YAML cannot read stays a string, and `key=` is ''."""
    if not raw.strip():
        return ""
    try:
        return yaml.safe_load(raw)
    except yaml.YAMLError:
        return raw


def dump_config(cfg: Config) -> str:
    """The config as nested YAML, loadable by `load_config`."""
    return yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False)


def flatten(data: Mapping[str, Any]) -> dict[str, Any]:
    """A config mapping (nested and/or dotted keys) as {dotted key: value}, older names read as ours."""
    out: dict[str, Any] = {}
    _flatten(data, "", out, [])
    return out


def _flatten(data: Mapping[str, Any], prefix: str, out: dict[str, Any], problems: list[Violation]) -> None:
    leaves, sections = schema_keys()
    for name, value in data.items():
        if not isinstance(name, str):
            problems.append(Violation(prefix + str(name), value, "keys must be strings", "quote the key"))
            continue
        key = KEY_ALIASES.get(prefix + name, prefix + name)
        if value is None and key in sections:
            continue  # `section:` with every key commented out
        if isinstance(value, Mapping) and key not in leaves:
            if value:
                _flatten(value, key + ".", out, problems)
            elif key not in sections:
                out[key] = value  # an empty unknown section is still an unknown key
        else:
            out[key] = value


NAME_LISTS = frozenset({"trainer.logger", "trainer.policy.model.lora.target_modules"})
"""List keys whose items are plain names (no commas in them): one name or a comma list is a list."""


def _build(flat: dict[str, Any], problems: list[Violation]) -> Config:
    leaves, sections = schema_keys()
    flat = _engine_init_kwargs_as_keys(_into_mappings(_without_removed(flat, problems), leaves), leaves)
    nested: dict[str, Any] = {}
    for key, value in flat.items():
        if key in leaves:
            node = nested
            *parents, leaf = key.split(".")
            for part in parents:
                node = node.setdefault(part, {})
            if key in NAME_LISTS and isinstance(value, str):  # `logger=wandb`, `logger=console,wandb`
                value = [part.strip() for part in value.strip("[] ").split(",") if part.strip()]
            node[leaf] = coerce(value, leaves[key])
        elif key in sections:
            example = next(k for k in leaves if k.startswith(key + "."))
            problems.append(
                Violation(key, value, "is a section, not a value", f"set its keys, e.g. {example}=...")
            )
        else:
            hint = suggest(key, list(leaves) + sorted(sections))
            fix = (
                f"did you mean '{hint}'?"
                if hint
                else "remove it (see inflight/config/schema.py for the keys)"
            )
            problems.append(Violation(key, value, "unknown key", fix))
    return _instantiate(Config, nested)


def _without_removed(flat: dict[str, Any], problems: list[Violation]) -> dict[str, Any]:
    """`flat` without the keys SkyRL removed (an accepted value is dropped, any other is a violation)."""
    out = {}
    for key, value in flat.items():
        if key not in REMOVED_KEYS:
            out[key] = value
            continue
        why, dropped = REMOVED_KEYS[key]
        if dropped is None or value != dropped and str(value).lower() != str(dropped).lower():
            problems.append(Violation(key, value, why, "remove it"))
    return out


def _into_mappings(flat: dict[str, Any], leaves: dict[str, Any]) -> dict[str, Any]:
    """Dotted keys below a mapping key (`...engine_init_kwargs.max_model_len=8`) as entries of that
    mapping."""
    out: dict[str, Any] = {}
    for key, value in flat.items():
        parent = None if key in leaves else _mapping_parent(key, leaves)
        if parent is None:
            out[key] = value
            continue
        node = out.setdefault(parent, {})
        if not isinstance(node, dict):
            out[key] = value  # the mapping key holds a non-mapping: validate reports it
            continue
        node = out[parent] = dict(node)
        *path, leaf = key[len(parent) + 1:].split(".")
        for part in path:
            node = node.setdefault(part, {})
        node[leaf] = value
    return out


def _mapping_parent(key: str, leaves: dict[str, Any]) -> str | None:
    parts = key.split(".")
    for end in range(len(parts) - 1, 0, -1):
        prefix = ".".join(parts[:end])
        if prefix in leaves:
            return prefix if is_mapping(leaves[prefix]) else None
    return None


def _engine_init_kwargs_as_keys(flat: dict[str, Any], leaves: dict[str, Any]) -> dict[str, Any]:
    """Entries of `engine_init_kwargs` that name a key of `generator.inference_engine`
    (`max_model_len`, ...) set that key: one source per setting; the rest stay (vLLM's arguments)."""
    kwargs = flat.get(ENGINE_INIT_KWARGS)
    if not isinstance(kwargs, dict):
        return flat
    out = dict(flat)
    rest = {}
    for name, value in kwargs.items():
        key = _IE + str(name)
        if key in leaves and key != ENGINE_INIT_KWARGS:
            out.setdefault(key, value)
        else:
            rest[name] = value
    out[ENGINE_INIT_KWARGS] = rest
    return out


def _instantiate(cls: type, values: dict[str, Any]) -> Any:
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name in values:
            tp = hints[f.name]
            kwargs[f.name] = (
                _instantiate(tp, values[f.name]) if dataclasses.is_dataclass(tp) else values[f.name]
            )
    return cls(**kwargs)
