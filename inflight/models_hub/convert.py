"""GGUF -> Hugging Face directory: transformers dequantizes, a plain `LlamaForCausalLM` takes the weights.

transformers' GGUF model is a quantized-model object (its `save_pretrained` refuses); its state dict
loads, strictly, into a plain model of the same config, which saves as an ordinary checkpoint."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch


@dataclass
class Reference:
    """transformers' reading of a GGUF file: the (dequantized) model and the tokenizer."""

    model: Any
    tokenizer: Any
    gguf_path: Path


def load_reference(gguf_path: Path) -> Reference:
    """Load `gguf_path` with transformers (the `gguf` package must be importable), in float32."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging

    logging.disable_progress_bar()
    folder, name = str(gguf_path.parent), gguf_path.name
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model.eval()
    return Reference(model, tokenizer, gguf_path)


def plain_model(reference: Reference) -> Any:
    """A plain transformers model of the reference's config holding its weights (strict load), float32."""
    from transformers import AutoModelForCausalLM

    config = reference.model.config.__class__.from_dict(reference.model.config.to_dict())
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path"):
        if hasattr(config, key):
            delattr(config, key)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(reference.model.state_dict(), strict=True)
    model.generation_config = reference.model.generation_config
    return model.eval()


def save(model: Any, reference: Reference, dtype: str, out: Path) -> Path:
    """`model` (float32) in `dtype` with the reference's tokenizer and chat template, as an HF directory."""
    tokenizer = reference.tokenizer
    tokenizer.model_max_length = model.config.max_position_embeddings
    cast = model if dtype == "float32" else copy.deepcopy(model).to(getattr(torch, dtype))
    cast.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out
