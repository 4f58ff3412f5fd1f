"""EngineConfig derived from `generator.inference_engine`: every field has one source, backends included."""

from __future__ import annotations

import dataclasses

import pytest

from inflight.config import Config, ConfigError, InferenceEngineConfig, load_config
from inflight.config.validate import CHOICES
from inflight.engine.config import NATIVE_BACKENDS, EngineConfig
from inflight.engine.models.linear import LINEAR_BACKENDS
from inflight.train.engine_settings import ENGINE_KEYS, PER_ENGINE, engine_config

IE = "generator.inference_engine."
NON_DEFAULT = {
    "device": "cpu:0", "dtype": "bfloat16", "block_size": 8, "num_kv_blocks": 12, "kv_cache_memory_gib": 0.5,
    "max_num_seqs": 3, "max_num_batched_tokens": 100, "max_model_len": 77, "enable_prefix_caching": False,
    "enable_chunked_prefill": False, "attention_backend": "torch", "linear_backend": "onednn_fp32",
    "elementwise_backend": "native", "weight_update_rollback": False, "weight_update_timeout_s": 7.5,
}  # fmt: skip


def test_every_engine_field_has_exactly_one_source():
    fields = [f.name for f in dataclasses.fields(EngineConfig)]
    assert sorted(ENGINE_KEYS + PER_ENGINE) == sorted(fields)
    assert not set(ENGINE_KEYS) & set(PER_ENGINE)
    assert set(NON_DEFAULT) == set(ENGINE_KEYS)


def test_schema_defaults_are_the_engine_defaults(tmp_path):
    ie = InferenceEngineConfig()
    for name in ENGINE_KEYS:
        assert getattr(ie, name) == getattr(EngineConfig(model="m"), name), name
    assert engine_config(Config(), tmp_path) == EngineConfig(model=str(tmp_path), seed=42)


def test_each_key_reaches_its_engine_field(tmp_path):
    cfg = load_config(None, [f"{IE}{k}={v}" for k, v in NON_DEFAULT.items()] + ["trainer.seed=7"])
    got = engine_config(cfg, tmp_path, weight_version=3, index=2)
    assert {k: getattr(got, k) for k in NON_DEFAULT} == NON_DEFAULT
    assert (got.model, got.seed, got.weight_version) == (str(tmp_path), 9, 3)


def test_backend_choices_are_the_engine_ones():
    assert CHOICES[IE + "attention_backend"][0] == NATIVE_BACKENDS
    assert CHOICES[IE + "elementwise_backend"][0] == NATIVE_BACKENDS
    assert CHOICES[IE + "linear_backend"][0] == LINEAR_BACKENDS


@pytest.mark.parametrize("key", ["attention_backend", "elementwise_backend", "linear_backend"])
def test_a_bad_backend_is_listed_with_key_and_fix(key):
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"{IE}{key}=torh", f"{IE}block_size=0"])
    assert err.value.keys == [f"{IE}block_size", f"{IE}{key}"]
    v = err.value.violations[1]
    assert v.value == "torh" and "must be one of" in v.rule and "did you mean 'torch'?" in v.fix
