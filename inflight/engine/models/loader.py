"""Pick the family from config.json and load safetensors weights from a local HF directory."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoConfig, PretrainedConfig

from inflight.engine.errors import ModelLoadError, WeightUpdateError
from inflight.engine.models.common import DecoderForCausalLM
from inflight.engine.models.llama import LlamaForCausalLM
from inflight.engine.models.qwen2 import Qwen2ForCausalLM
from inflight.engine.models.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration
from inflight.engine.models.qwen2_moe import Qwen2MoeForCausalLM
from inflight.engine.models.qwen3 import Qwen3ForCausalLM
from inflight.engine.models.qwen3_moe import Qwen3MoeForCausalLM
from inflight.engine.models.qwen3_vl import Qwen3VLForConditionalGeneration

ARCHITECTURES: dict[str, type[DecoderForCausalLM]] = {
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "Qwen2_5_VLForConditionalGeneration": Qwen2_5_VLForConditionalGeneration,
    "Qwen3VLForConditionalGeneration": Qwen3VLForConditionalGeneration,
}
_BY_MODEL_TYPE = {
    "qwen2": Qwen2ForCausalLM,
    "qwen3": Qwen3ForCausalLM,
    "llama": LlamaForCausalLM,
    "qwen2_moe": Qwen2MoeForCausalLM,
    "qwen3_moe": Qwen3MoeForCausalLM,
    "qwen2_5_vl": Qwen2_5_VLForConditionalGeneration,
    "qwen3_vl": Qwen3VLForConditionalGeneration,
}


def load_config(model_dir: str | Path) -> PretrainedConfig:
    path = Path(model_dir)
    if not path.is_dir():
        raise ModelLoadError(
            f"model directory {str(path)!r} does not exist; give a local Hugging Face model dir"
        )
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{str(path)!r} has no config.json; it is not a Hugging Face model directory")
    return AutoConfig.from_pretrained(path)


def model_class(config: PretrainedConfig) -> type[DecoderForCausalLM]:
    archs = [a for a in getattr(config, "architectures", None) or [] if a in ARCHITECTURES]
    cls = ARCHITECTURES[archs[0]] if archs else _BY_MODEL_TYPE.get(getattr(config, "model_type", ""))
    if cls is None:
        archs = getattr(config, "architectures", None)
        raise ModelLoadError(
            f"unsupported architecture {archs or config.model_type!r}; supported: {', '.join(ARCHITECTURES)}"
        )
    if getattr(config, "use_sliding_window", False):
        raise ModelLoadError("sliding-window attention (use_sliding_window=true) is not supported")
    return cls


def iter_safetensors(model_dir: str | Path):
    """Yield (hf_name, tensor) from every *.safetensors file of the directory."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise ModelLoadError(
            f"{str(model_dir)!r} has no *.safetensors weights (pytorch .bin is not supported)"
        )
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():
                yield name, handle.get_tensor(name)


def load_model(model_dir: str | Path, dtype: torch.dtype, device: torch.device) -> DecoderForCausalLM:
    """Build the family's module without random init and fill it from the checkpoint."""
    config = load_config(model_dir)
    cls = model_class(config)
    with torch.device("meta"):
        model = cls(config)
    model = model.to_empty(device=device).to(dtype)
    if model.tie_word_embeddings:  # to_empty unties shared parameters
        model.lm_head.weight = model.model.embed_tokens.weight
    try:
        loaded = model.copy_weights(model.split_fused(iter_safetensors(model_dir)))
    except WeightUpdateError as err:
        raise ModelLoadError(f"checkpoint in {str(model_dir)!r} does not match its config: {err}") from err
    missing = model.hf_parameter_names() - loaded
    if missing:
        raise ModelLoadError(f"checkpoint in {str(model_dir)!r} lacks parameters: {sorted(missing)[:5]}")
    model.init_rotary(device)
    return model.eval().requires_grad_(False)
