"""No key parsed and ignored: every schema key is read by the package, or refused by a run."""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

import pytest

from inflight.config import ConfigError, load_config
from inflight.config.implemented import NOT_IMPLEMENTED, unimplemented
from inflight.config.keys import schema_keys
from inflight.train.engine_settings import engine_config
from inflight.train.step import StepOptions

PACKAGE = Path(__file__).resolve().parents[2] / "inflight"
REFUSED_VALUES = {
    "generator.inference_engine.tensor_parallel_size": 2,
}


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
def test_every_key_has_a_reader_or_is_refused(key):
    if key in NOT_IMPLEMENTED:
        return
    field = key.rsplit(".", 1)[-1]
    assert readers(field), f"{key} is parsed but nothing reads `.{field}`: read it or refuse it (config/implemented.py)"


def test_the_reader_search_sees_reads_and_misses_unread_names():
    assert readers("max_staleness_steps") and readers("attention_backend")  # the engine reads its backends
    assert readers("a_field_nobody_has") == []


def test_refused_keys_are_schema_keys_and_defaults_are_implemented():
    from inflight.config import Config

    assert set(NOT_IMPLEMENTED) <= set(schema_keys()[0]) and set(REFUSED_VALUES) == set(NOT_IMPLEMENTED)
    assert unimplemented(Config()) == []


@pytest.mark.parametrize("key", sorted(REFUSED_VALUES))
def test_a_run_refuses_what_is_not_implemented(key, tmp_path):
    cfg = load_config(None, [f"{key}={REFUSED_VALUES[key]}"])  # valid SkyRL config: the plan covers it
    for build in (lambda: engine_config(cfg, tmp_path), lambda: StepOptions.from_config(cfg)):
        with pytest.raises(ConfigError) as err:
            build()
        (v,) = err.value.violations
        assert v.key == key and v.value == REFUSED_VALUES[key] and "not implemented yet" in v.rule
        assert key in v.fix


def test_lora_is_implemented_and_refused_only_where_it_is_not():
    cfg = load_config(None, ["trainer.policy.model.lora.rank=16", "trainer.policy.model.lora.alpha=32"])
    StepOptions.from_config(cfg)  # the local worker trains LoRA: nothing refused
    with pytest.raises(ConfigError) as err:
        load_config(None, ["trainer.policy.model.lora.rank=8", "trainer.strategy=megatron",
                           "trainer.placement.policy_num_gpus_per_node=2"])
    assert [v.rule.split(" is ")[0] for v in err.value.violations] == [
        "LoRA with trainer.strategy=megatron", "LoRA on more than one policy rank"]
    # sleeping engines take the merged weights instead of the adapter: accepted
    load_config(None, ["trainer.policy.model.lora.rank=8", "trainer.placement.colocate_all=true",
                       "trainer.fully_async.enabled=false"])
