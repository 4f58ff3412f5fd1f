"""EngineConfig derived from `generator.inference_engine`: every field has one source, backends included."""

from __future__ import annotations

import dataclasses

import pytest

from inflight.config import ConfigError, load_config
from inflight.config.keys import schema_choices
from inflight.engine.config import NATIVE_BACKENDS, EngineConfig
from inflight.engine.models.linear import LINEAR_BACKENDS
from inflight.orchestration.engine_settings import ENGINE_KEYS, PER_ENGINE, RENAMED, engine_config
from inflight.testing import LOCAL_CPU

IE = "generator.inference_engine."
NON_DEFAULT = {
    "device": "cpu:0", "model_dtype": "float16", "block_size": 8, "num_kv_blocks": 12,
    "max_num_seqs": 3, "max_num_batched_tokens": 100, "max_model_len": 77, "enable_prefix_caching": False,
    "enable_chunked_prefill": False, "attention_backend": "torch", "linear_backend": "onednn_fp32",
    "elementwise_backend": "native", "weight_update_rollback": False, "weight_update_timeout_s": 7.5,
}  # fmt: skip


def test_every_engine_field_has_exactly_one_source():
    fields = [f.name for f in dataclasses.fields(EngineConfig)]
    assert sorted(ENGINE_KEYS + PER_ENGINE) == sorted(fields)
    assert not set(ENGINE_KEYS) & set(PER_ENGINE)
    assert {RENAMED.get(k, k) for k in ENGINE_KEYS} == set(NON_DEFAULT)


def test_the_engine_settings_are_the_keys_values(tmp_path):
    # otherwise SkyRL's defaults
    cfg = load_config(None, [f"{IE}backend=native", f"{IE}kv_cache_memory_gib=0.5"])
    expected = {
        name: getattr(cfg.generator.inference_engine, RENAMED.get(name, name)) for name in ENGINE_KEYS
    }
    got = engine_config(cfg, tmp_path)
    assert {name: getattr(got, name) for name in ENGINE_KEYS} == expected
    assert (got.seed, got.kv_cache_memory_gib) == (42, 0.5)


def test_each_key_reaches_its_engine_field(tmp_path):
    overrides = [f"{IE}{k}={v}" for k, v in NON_DEFAULT.items()]
    cfg = load_config(None, [*LOCAL_CPU, *overrides, "trainer.seed=7", f"{IE}kv_cache_memory_gib=0.5"])
    got = engine_config(cfg, tmp_path, weight_version=3, index=2)
    assert {RENAMED.get(k, k): getattr(got, k) for k in ENGINE_KEYS} == NON_DEFAULT
    assert (got.model, got.seed, got.weight_version, got.kv_cache_memory_gib) == (str(tmp_path), 9, 3, 0.5)


def test_gpu_memory_utilization_sizes_the_kv_cache_from_the_memory_left(tmp_path):
    from transformers import AutoConfig

    from inflight.orchestration.engine_memory import MIN_KV_GIB, available_bytes, kv_cache_gib, weight_bytes
    from inflight.testing import make_tiny_model

    model = make_tiny_model(tmp_path / "m", arch="qwen2")
    ie = load_config(None, [f"{IE}gpu_memory_utilization=0.5", f"{IE}num_engines=2",
                            "trainer.placement.colocate_all=false"]).generator.inference_engine
    budget = 0.5 * available_bytes("cpu") / 2 - weight_bytes(model, "bfloat16")
    hf = AutoConfig.from_pretrained(model)
    head_dim = hf.hidden_size // hf.num_attention_heads  # Qwen2 has no head_dim of its own
    per_token = 2 * hf.num_hidden_layers * hf.num_key_value_heads * head_dim * 2  # bf16 keys and values
    # SkyRL's 1024 requests, the model's context
    usable = ie.max_num_seqs * hf.max_position_embeddings * per_token
    assert kv_cache_gib(ie, model, engines_on_host=2) == pytest.approx(min(budget, usable) / 2**30, rel=0.05)
    small = load_config(None, [f"{IE}max_num_seqs=64", f"{IE}max_model_len=512",
                               "trainer.placement.colocate_all=false"]).generator.inference_engine
    assert kv_cache_gib(small, model, engines_on_host=1) == pytest.approx(
        max(MIN_KV_GIB, 64 * 512 * per_token / 2**30)
    )
    assert weight_bytes(model, "float32") == 2 * weight_bytes(model, "bfloat16") > 0


def test_backend_choices_are_the_engine_ones():
    assert schema_choices()[IE + "attention_backend"][0] == NATIVE_BACKENDS
    assert schema_choices()[IE + "elementwise_backend"][0] == NATIVE_BACKENDS
    assert schema_choices()[IE + "linear_backend"][0] == LINEAR_BACKENDS


@pytest.mark.parametrize("key", ["attention_backend", "elementwise_backend", "linear_backend"])
def test_a_bad_backend_is_listed_with_key_and_fix(key):
    with pytest.raises(ConfigError) as err:
        load_config(None, [*LOCAL_CPU, f"{IE}{key}=torh", f"{IE}block_size=0"])
    assert err.value.keys == [f"{IE}block_size", f"{IE}{key}"]
    v = err.value.violations[1]
    assert v.value == "torh" and "must be one of" in v.rule and "did you mean 'torch'?" in v.fix
