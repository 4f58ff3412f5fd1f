"""Configuration: the typed schema (SkyRL key names), YAML + dotted overrides, and validate()."""

from inflight.config.errors import ConfigError, Violation
from inflight.config.loader import KEY_ALIASES, config_from_dict, dump_config, load_config, parse_override
from inflight.config.schema import (
    AlgorithmConfig,
    Config,
    FullyAsyncConfig,
    GeneratorConfig,
    InferenceEngineConfig,
    LoraConfig,
    MegatronConfig,
    ModelConfig,
    OffPolicyCorrectionConfig,
    OptimizerConfig,
    PlacementConfig,
    PolicyConfig,
    SamplingConfig,
    TrainerConfig,
    canonical_strategy,
    canonical_weight_sync_backend,
)
from inflight.config.validate import SYNC_KEYS, collect_violations, validate, validate_sync

__all__ = [
    "KEY_ALIASES",
    "SYNC_KEYS",
    "AlgorithmConfig",
    "Config",
    "ConfigError",
    "FullyAsyncConfig",
    "GeneratorConfig",
    "InferenceEngineConfig",
    "LoraConfig",
    "MegatronConfig",
    "ModelConfig",
    "OffPolicyCorrectionConfig",
    "OptimizerConfig",
    "PlacementConfig",
    "PolicyConfig",
    "SamplingConfig",
    "TrainerConfig",
    "Violation",
    "canonical_strategy",
    "canonical_weight_sync_backend",
    "collect_violations",
    "config_from_dict",
    "dump_config",
    "load_config",
    "parse_override",
    "validate",
    "validate_sync",
]
