"""`EngineConfig` derived from the config schema: one source for every engine setting.

Each `EngineConfig` field is either a `generator.inference_engine` key of the same name
(`ENGINE_KEYS`) or given per engine (`PER_ENGINE`: the model directory, the seed, the weight
version). The engine stays self-contained: it knows nothing of the schema, this module maps one
onto the other.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from inflight.config import Config, InferenceEngineConfig
from inflight.config.implemented import require_implemented
from inflight.engine.config import EngineConfig
from inflight.orchestration.engine_memory import kv_cache_gib

PER_ENGINE = ("model", "seed", "weight_version", "kv_cache_memory_gib")
"""EngineConfig fields set per engine, not by a key of the same name: model <- the model directory,
seed <- `trainer.seed` + the engine's index, weight_version <- the version the weights are,
kv_cache_memory_gib <- `kv_cache_memory_gib` or `gpu_memory_utilization` (`engine_memory.kv_cache_gib`)."""
RENAMED = {"dtype": "model_dtype"}
"""EngineConfig fields whose key has SkyRL's name: `dtype` <- `generator.inference_engine.model_dtype`."""
_SCHEMA_FIELDS = {g.name for g in dataclasses.fields(InferenceEngineConfig)}
ENGINE_KEYS = tuple(f.name for f in dataclasses.fields(EngineConfig)
                    if RENAMED.get(f.name, f.name) in _SCHEMA_FIELDS and f.name not in PER_ENGINE)
"""EngineConfig fields read from `generator.inference_engine.<same name>` (or its `RENAMED` key)."""


def engine_config(
    cfg: Config, model_dir: str | Path, weight_version: int = 0, index: int = 0
) -> EngineConfig:
    """The settings of engine `index` of `generator.inference_engine` for `model_dir`; each engine
    gets its own sampling seed, or unseeded requests would sample alike on every engine. Raises
    ConfigError for keys set to what is not implemented yet (`inflight.config.implemented`)."""
    require_implemented(cfg)
    ie = cfg.generator.inference_engine
    return EngineConfig(model=str(model_dir), seed=cfg.trainer.seed + index, weight_version=weight_version,
                        kv_cache_memory_gib=kv_cache_gib(ie, model_dir, ie.num_engines),
                        **{name: getattr(ie, RENAMED.get(name, name)) for name in ENGINE_KEYS})
