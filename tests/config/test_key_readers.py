"""No key parsed and ignored: every schema key is read by the package, accepted with a reason, or
refused by a run with a reason; and the schema holds every SkyRL key with SkyRL's default."""

from __future__ import annotations

import ast
import dataclasses
import os
import re
import typing
from functools import cache
from pathlib import Path

import pytest

from inflight.config import Config, ConfigError, load_config
from inflight.config.implemented import refused_keys, require_implemented, unimplemented
from inflight.config.keys import (
    default_config,
    get_key,
    is_instance,
    schema_choices,
    schema_fields,
    schema_keys,
)
from inflight.config.status import ACCEPTED, IMPLEMENTED, REFUSED, field_status, is_skyrl
from inflight.orchestration.engine_settings import engine_config
from inflight.train.step import StepOptions

PACKAGE = Path(__file__).resolve().parents[2] / "inflight"
SKYRL_KEYS = Path(__file__).with_name("data") / "skyrl_config_keys.tsv"
"""SkyRL's every leaf key and default (NovaSky-AI/SkyRL skyrl/train/config/config.py)."""


@cache
def _sources() -> dict[Path, str]:
    """The package's source outside config/ (the schema, validation and loader do not count as
    readers: they check a key, they do not act on it)."""
    return {p: p.read_text() for p in PACKAGE.rglob("*.py") if PACKAGE / "config" not in p.parents}


def readers(field: str) -> list[Path]:
    """Files that read an attribute named `field` (`x.field`, also `getattr(x, "field")`)."""
    pattern = re.compile(rf"\.{field}\b|getattr\([^,]+,\s*[\"']{field}[\"']")
    return [p for p, text in _sources().items() if pattern.search(text)]


@pytest.mark.parametrize("key", sorted(schema_keys()[0]))
def test_every_key_has_a_status_and_an_implemented_key_a_reader(key):
    status = field_status(schema_fields()[key])
    assert status.state in (IMPLEMENTED, ACCEPTED, REFUSED)
    if status.state == IMPLEMENTED:
        field = key.rsplit(".", 1)[-1]
        assert readers(field), (
            f"{key} is implemented but nothing reads `.{field}`: read it, or give it a status"
        )
    else:
        assert len(status.note) > 20, f"{key} is {status.state} without a reason"
    if status.state == REFUSED:
        assert status.takes(get_key(default_config(), key), get_key(default_config(), key)), \
            f"{key}: its default must run"


def test_the_reader_search_sees_reads_and_misses_unread_names():
    assert readers("max_staleness_steps") and readers("attention_backend")  # the engine reads its backends
    assert readers("a_field_nobody_has") == []


def _skyrl_reference() -> dict[str, str]:
    rows = [line.rstrip("\n").split("\t") for line in SKYRL_KEYS.read_text().splitlines()
            if line and not line.startswith("#")]
    return {key: default for key, default in rows[1:]}


def _sections(cls: type = Config, prefix: str = "") -> set[str]:
    out = set()
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            out.add(prefix + f.name)
            out |= _sections(hints[f.name], prefix + f.name + ".")
    return out


def test_every_skyrl_key_is_a_key_or_a_section_of_ours():
    leaves, sections = schema_keys()[0], _sections()
    missing = [key for key in _skyrl_reference() if key not in leaves and key not in sections]
    assert missing == [], f"SkyRL keys the schema lacks: {missing}"
    ours = [key for key, f in schema_fields().items() if not is_skyrl(f)]
    assert all(key not in _skyrl_reference() for key in ours), "a key marked ours is SkyRL's"
    assert len(ours) < 45, f"keys of our own stay few: {len(ours)}"


def _parse_default(text: str):
    """A reference default as a value (`lambda: [0.9, 0.999]`, `'fsdp'`, `None`, `dict`); ... for the
    ones that are only names (a dataclass, a deep copy)."""
    text = text.strip()
    if text.startswith("lambda:"):
        text = text[len("lambda:"):].strip()
    if text == "dict":
        return {}
    if "expanduser(" in text:
        paths = [os.path.expanduser(p) for p in re.findall(r"expanduser\('([^']*)'\)", text)]
        return paths if text.startswith("[") else paths[0]
    try:
        return ast.literal_eval(text) if text else ""
    except (ValueError, SyntaxError):
        return ...


@pytest.mark.parametrize("key", sorted(k for k in _skyrl_reference() if k in schema_keys()[0]))
def test_skyrl_keys_have_skyrl_defaults(key):
    expected = _parse_default(_skyrl_reference()[key])
    if expected is ...:
        pytest.skip(f"the reference names no literal default for {key}")
    ours = get_key(Config(), key)
    if isinstance(expected, list) and all(isinstance(e, str) and "expanduser" not in e for e in expected):
        expected = [str(Path(e).expanduser()) if e.startswith("~") else e for e in expected]
    if key.endswith("transformer_config_kwargs") or key.endswith("optimizer_config_kwargs"):
        assert isinstance(ours, dict) and ours
        return
    if isinstance(expected, str) and key in ("trainer.logger", "trainer.policy.model.lora.target_modules",
                                             "trainer.ref.model.lora.target_modules",
                                             "trainer.critic.model.lora.target_modules"):
        expected = [expected]  # a name list: one name is a list of one
    if key == "generator.inference_engine.weight_sync_backend":
        expected = "broadcast"  # SkyRL's nccl, read as the broadcast group
    # The snapshot's CISPO band is a later SkyRL's; ours is 0.3.0's, checked against its own dataclass
    # (tests/algorithms/test_policy_losses.py::test_algorithm_defaults_are_skyrl_0_3_0s_key_by_key).
    expected = {"trainer.algorithm.cispo.cispo_eps_clip_low": 0.0,
                "trainer.algorithm.cispo.cispo_eps_clip_high": 5.0}.get(key, expected)
    assert ours == expected, f"{key}: ours {ours!r}, SkyRL's {expected!r}"


NEEDS = {"trainer.algorithm.use_kl_in_reward": ["trainer.algorithm.use_kl_loss=false"]}
"""Overrides a refused value needs to be a valid config."""


def _refused_value(key: str):
    """A valid value of `key` that its refused status does not run."""
    f, default = schema_fields()[key], get_key(default_config(), key)
    status = field_status(f)
    tp = typing.get_type_hints(_owner(key))[key.rsplit(".", 1)[-1]]
    candidates = [
        True,
        False,
        2,
        0,
        -3,
        7.5,
        0.5,
        *schema_choices().get(key, ((),))[0],
        "replace",
        "geometric",
        "other",
        ["x"],
        {"x": 1},
        None,
    ]
    for value in candidates:
        if not is_instance(value, tp) or status.takes(value, default):
            continue
        try:
            load_config(None, [f"{key}={_override(value)}", *NEEDS.get(key, [])])
        except ConfigError:
            continue
        return value
    raise AssertionError(f"no valid refused value found for {key}")


def _owner(key: str) -> type:
    cls = Config
    for part in key.split(".")[:-1]:
        cls = typing.get_type_hints(cls)[part]
    return cls


@pytest.mark.parametrize("key", sorted(refused_keys()))
def test_a_run_refuses_what_is_not_implemented_and_validate_accepts_it(key, tmp_path):
    value = _refused_value(key)
    # valid SkyRL config: it loads
    cfg = load_config(None, [f"{key}={_override(value)}", *NEEDS.get(key, [])])
    violations = [v for v in unimplemented(cfg) if v.key == key]
    assert len(violations) == 1 and violations[0].value == value and violations[0].fix
    with pytest.raises(ConfigError) as err:
        require_implemented(cfg)
    assert key in err.value.keys


def _override(value) -> str:
    import json

    return "null" if value is None else json.dumps(value) if not isinstance(value, str) else value


def test_engines_and_steps_refuse_what_is_not_implemented(tmp_path):
    cfg = load_config(None, ["generator.inference_engine.tensor_parallel_size=2"])
    for build in (lambda: engine_config(cfg, tmp_path), lambda: StepOptions.from_config(cfg)):
        with pytest.raises(ConfigError) as err:
            build()
        assert "generator.inference_engine.tensor_parallel_size" in err.value.keys


def test_lora_is_refused_only_where_it_is_not_implemented():
    two_ranks = ["trainer.policy.model.lora.rank=8", "trainer.placement.policy_num_gpus_per_node=2",
                 "generator.inference_engine.num_engines=2"]
    # megatron's ranks take it
    require_implemented(load_config(None, [*two_ranks, "trainer.strategy=megatron"]))
    with pytest.raises(ConfigError) as err:
        require_implemented(load_config(None, [*two_ranks, "trainer.strategy=fsdp",
                                               "trainer.policy.megatron_config.lora_config.lora_type=canonical_lora"]))
    rules = {v.key: v.rule for v in err.value.violations}
    assert rules["trainer.policy.model.lora.rank"].startswith("LoRA on more than one FSDP policy rank")
    assert "canonical_lora" in rules["trainer.policy.megatron_config.lora_config.lora_type"]
