"""The model shapes vLLM's CPU build serves, checked before vLLM starts: THE rule, read by the shim at
start-up (`server.main`, in vLLM's interpreter) and by a run's refusals (`inflight.train.main.run_refusals`,
in the project's), so a model vLLM cannot attend is refused at once, not at its first request (vLLM
0.32 loads it and then fails every request with "EngineCore encountered an issue").

Standard library only: this module runs in both interpreters.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
"""vLLM 0.32's `CPUAttentionBackend.get_supported_head_sizes()` (its CPU kernels dispatch on exactly these and
refuse others: "Unsupported CPU attention configuration: head_dim=..."); a test holds them equal."""


def head_size(config: dict[str, Any]) -> int | None:
    """A model's attention head size as vLLM derives it for the architectures served here: `head_dim`
    when set (> 0), else hidden_size / num_attention_heads (None when config.json has neither)."""
    config = _text(config)
    if (size := config.get("head_dim")) is not None and size > 0:
        return int(size)
    hidden, heads = config.get("hidden_size"), config.get("num_attention_heads")
    return int(hidden) // int(heads) if hidden and heads else None


def cpu_attention_problem(model_dir: str | Path) -> str | None:
    """Why vLLM's CPU attention cannot serve the model in `model_dir` (its head size, from config.json,
    and the ones vLLM takes), or None when it can or config.json is not there to tell. Callers add the fix."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        return None
    config = _text(json.loads(path.read_text()))
    size = head_size(config)
    if size is None or size in CPU_HEAD_SIZES:
        return None
    how = (
        "head_dim"
        if config.get("head_dim")
        else (f"hidden_size {config['hidden_size']} / num_attention_heads {config['num_attention_heads']}")
    )
    return (
        f"vLLM 0.32's CPU attention cannot serve the model in {model_dir}: its head size is {size} ({how} in "
        f"config.json), and vLLM's CPU kernels take head sizes {', '.join(map(str, CPU_HEAD_SIZES))} only"
    )


def _text(config: dict[str, Any]) -> dict[str, Any]:
    """The language model's part of a config (multimodal configs nest it, as vLLM's hf_text_config)."""
    return config.get("text_config") or config


__all__ = ["CPU_HEAD_SIZES", "cpu_attention_problem", "head_size"]
