"""The typed configuration schema: nested dataclasses whose dotted paths are the config keys.

The tree is SkyRL's (`NovaSky-AI/SkyRL`, `skyrl/train/config/config.py`): every SkyRL key with
SkyRL's name and default, so a SkyRL config or launch script means here what it means there. The
keys SkyRL lacks sit beside its own, declared with `ours(...)`, and are few. Every field declares
its status (`inflight.config.status`: implemented, accepted, or refused with the reason), which the
validator, the refusals of a run and the generated reference (`docs/reference/config.md`) read.

Sections: `models.py` (policy, reference, critic, optimizer, LoRA, FSDP, Megatron),
`algorithm.py` (trainer.algorithm), `trainer.py` (trainer), `generator.py` (generator and the
inference engines), `data.py` (data, environment).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from inflight.config.schema.algorithm import (
    AlgorithmConfig,
    CISPOConfig,
    ClipCovConfig,
    DPPOConfig,
    DynamicSamplingConfig,
    KLCovConfig,
    KLCtrlConfig,
    OffPolicyCorrectionConfig,
    SAPOConfig,
)
from inflight.config.schema.data import (
    DataConfig,
    DataLoaderConfig,
    EnvironmentConfig,
    LLMJudgeConfig,
    SearchConfig,
    SkyRLGymConfig,
    Text2SQLConfig,
)
from inflight.config.schema.generator import (
    WEIGHT_SYNC_BACKEND_ALIASES,
    ChatTemplateConfig,
    DeltaWeightSyncConfig,
    GeneratorConfig,
    InferenceEngineConfig,
    RateLimitConfig,
    SamplingConfig,
    canonical_weight_sync_backend,
)
from inflight.config.schema.models import (
    CriticConfig,
    DDPConfig,
    FakeInt4QatConfig,
    FSDPConfig,
    HFExportConfig,
    LoraConfig,
    MegatronConfig,
    MegatronLoraConfig,
    MixedPrecisionConfig,
    ModelConfig,
    OptimizerConfig,
    PolicyConfig,
    RefConfig,
    TorchProfilerConfig,
)
from inflight.config.schema.trainer import (
    STRATEGY_ALIASES,
    FullyAsyncConfig,
    MTPConfig,
    PlacementConfig,
    TrainerConfig,
    canonical_strategy,
)


@dataclass
class Config:
    """Everything a run needs. `Config()` is SkyRL's default configuration."""

    data: DataConfig = field(default_factory=DataConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    generator: GeneratorConfig = field(default_factory=GeneratorConfig)
    environment: EnvironmentConfig = field(default_factory=EnvironmentConfig)


__all__ = [
    "STRATEGY_ALIASES", "WEIGHT_SYNC_BACKEND_ALIASES", "AlgorithmConfig", "CISPOConfig", "ChatTemplateConfig",
    "ClipCovConfig", "Config", "CriticConfig", "DDPConfig", "DPPOConfig", "DataConfig", "DataLoaderConfig",
    "DeltaWeightSyncConfig", "DynamicSamplingConfig", "EnvironmentConfig", "FSDPConfig", "FakeInt4QatConfig",
    "FullyAsyncConfig", "GeneratorConfig", "HFExportConfig", "InferenceEngineConfig", "KLCovConfig",
    "KLCtrlConfig", "LLMJudgeConfig", "LoraConfig", "MTPConfig", "MegatronConfig", "MegatronLoraConfig",
    "MixedPrecisionConfig", "ModelConfig", "OffPolicyCorrectionConfig", "OptimizerConfig", "PlacementConfig",
    "PolicyConfig", "RateLimitConfig", "RefConfig", "SAPOConfig", "SamplingConfig", "SearchConfig",
    "SkyRLGymConfig", "Text2SQLConfig", "TorchProfilerConfig", "TrainerConfig", "canonical_strategy",
    "canonical_weight_sync_backend",
]
