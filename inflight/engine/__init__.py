"""Native paged-KV inference engine with weight-versioned KV and in-flight weight updates."""

from inflight.engine.async_engine import AsyncEngine
from inflight.engine.config import EngineConfig
from inflight.engine.engine import LLMEngine
from inflight.engine.errors import (
    EngineError,
    EngineStateError,
    InvalidRequestError,
    ModelLoadError,
    WeightUpdateError,
)
from inflight.engine.request import RequestOutput, RequestStatus, SamplingParams
from inflight.engine.stats import EngineStats

__all__ = [
    "AsyncEngine",
    "EngineConfig",
    "EngineError",
    "EngineStateError",
    "EngineStats",
    "InvalidRequestError",
    "LLMEngine",
    "ModelLoadError",
    "RequestOutput",
    "RequestStatus",
    "SamplingParams",
    "WeightUpdateError",
]
