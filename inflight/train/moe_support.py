"""Which policy workers take a mixture-of-experts model, checked at start-up from the model's config.

The local and FSDP workers train transformers' MoE models (with routing replay,
`inflight.train.moe_replay`); the Megatron worker's conversion and CPU shim hold dense models
only, so an MoE model there is refused naming `trainer.strategy`. Routing replay asked of a dense
model is refused naming its key.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from inflight.config import Config, ConfigError, Violation
from inflight.train.moe_replay import REPLAY_KEY, replay_enabled
from inflight.train.strategies import strategy_entry

EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts")
"""Hugging Face config fields that give a mixture of experts' expert count."""


def is_moe_config(config: dict[str, Any]) -> bool:
    """Whether a Hugging Face config (config.json's mapping) describes a mixture of experts."""
    return any(int(config.get(key) or 0) > 0 for key in EXPERT_COUNTS)


def check_worker_supports(cfg: Config, model_dir: str | Path, kind: str, role: str = "policy") -> None:
    """Raise ConfigError when the `kind` worker (an `inflight.train.strategies` entry's name) cannot train the
    model in `model_dir` as `cfg` asks: an MoE model on a worker that refuses them (Megatron's); routing
    replay of a dense model."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        return  # the worker's loader says what is missing
    config = json.loads(path.read_text())
    moe, problems = is_moe_config(config), []
    name = config.get("model_type", "?")
    refusal = strategy_entry(kind).moe_refusal
    if moe and refusal:
        key, value = ("trainer.strategy", cfg.trainer.strategy) \
            if strategy_entry(cfg.trainer.strategy).name == kind else ("job.worker", kind)
        problems.append(Violation(key, value, f"{refusal}; {model_dir} is a mixture of experts ({name})",
                                  "use trainer.strategy=fsdp (the local and FSDP workers train MoE "
                                  "models, with routing replay)"))
    if replay_enabled(cfg, role) and not moe:
        key = REPLAY_KEY.format(role=role)
        problems.append(
            Violation(
                key,
                True,
                f"{model_dir} ({name}) has no mixture-of-experts layers to replay",
                f"set {key}=false, or train a Qwen3-MoE / Qwen2-MoE model",
            )
        )
    if problems:
        raise ConfigError(problems)


__all__ = ["EXPERT_COUNTS", "check_worker_supports", "is_moe_config"]
