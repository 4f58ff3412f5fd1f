"""A string key's allowed values are declared on its schema field (`choices=` / `aliases=` of
`inflight.config.status.skyrl`), and validation reads them there: a field that declares choices is
checked with no other file touched, with the messages validation always gave."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from oracle_import import import_oracle

from inflight.config import ConfigError, load_config
from inflight.config.keys import get_key, schema_choices, schema_fields
from inflight.config.schema import Config
from inflight.config.status import ours, skyrl
from inflight.testing import LOCAL_CPU


@dataclass
class _Section:
    mode: str = skyrl("a", choices=("a", "b"), aliases={"A": "a"})
    free: str = ours("x")


def test_choices_are_read_from_the_fields():
    assert schema_choices(_Section) == {"mode": (("a", "b"), {"A": "a"})}
    fields = schema_fields()
    for key, (allowed, aliases) in schema_choices().items():
        assert fields[key].metadata["choices"] == allowed, key
        default = get_key(Config(), key)
        assert default in allowed or default in aliases, f"{key}: default {default!r} not among its choices"


@pytest.mark.parametrize("key", sorted(schema_choices()))
def test_a_value_outside_the_fields_choices_is_refused_naming_them(key):
    allowed, _ = schema_choices()[key]
    with pytest.raises(ConfigError) as err:
        load_config(None, [*LOCAL_CPU, f"{key}={allowed[0]}zz"])
    (v,) = [v for v in err.value.violations if v.key == key]
    assert v.rule == f"must be one of {', '.join(allowed)}"
    assert v.fix == f"did you mean '{allowed[0]}'? use one of {list(allowed)}"


def test_aliases_declared_on_the_field_are_taken():
    cfg = load_config(None, [*LOCAL_CPU, "trainer.strategy=fsdp2",
                             "generator.inference_engine.model_dtype=bf16"])
    assert cfg.trainer.strategy == "fsdp" and cfg.generator.inference_engine.model_dtype == "bfloat16"


def test_dppo_types_are_the_ones_skyrl_accepts():
    dppo = import_oracle("skyrl.train.config.config").DPPOConfig
    allowed, _ = schema_choices()["trainer.algorithm.dppo.dppo_type"]
    for value in allowed:
        assert dppo(dppo_type=value).dppo_type == value
    with pytest.raises(ValueError, match="Invalid DPPO type"):
        dppo(dppo_type="binary_js")
