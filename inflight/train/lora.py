"""LoRA policies through `peft`: the adapter is what trains, what a weight sync sends and what a
checkpoint holds beside the merged model.

`apply_lora` wraps a transformers model in a `peft` LoRA model (`trainer.policy.model.lora.*`): the
base weights are frozen, so the optimizer (built over the parameters that require gradients) holds
only the adapters. `adapter_tensors` is the sync's payload in the engine's naming
(`inflight.engine.adapters`): per adapted layer `<m>.lora_A.weight` and `<m>.lora_B.weight` times
the layer's scaling. `merged_tensors` is the full model with every adapter merged (the HF export). `save_adapter` and
`load_adapter` write and read a checkpoint's adapter in peft's own format.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch

from inflight.config import Config

_PREFIX = "base_model.model."


def lora_enabled(cfg: Config) -> bool:
    return cfg.trainer.policy.model.lora.rank > 0


def apply_lora(model: torch.nn.Module, cfg: Config) -> torch.nn.Module:
    """`model` as a `peft` LoRA model per `trainer.policy.model.lora`; only the adapters train."""
    try:
        import peft
    except ImportError as err:
        raise RuntimeError("trainer.policy.model.lora.rank > 0 needs peft: pip install torch==2.13.0 peft "
                           "(or: pip install torch==2.13.0 -e '.[lora]')") from err
    lora = cfg.trainer.policy.model.lora
    targets = lora.target_modules
    config = peft.LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                             target_modules="all-linear" if targets == ["all-linear"] else list(targets),
                             exclude_modules=list(lora.exclude_modules) if lora.exclude_modules else None,
                             init_lora_weights=init_lora_weights(lora.init_method))
    return peft.get_peft_model(model, config)


INIT_METHODS = {"kaiming": True, "gaussian": "gaussian"}
"""SkyRL's `lora.init_method` names as peft's `init_lora_weights` (peft's own names pass through)."""


def init_lora_weights(method: str) -> bool | str:
    """peft's `init_lora_weights` for `trainer.policy.model.lora.init_method`."""
    return INIT_METHODS.get(method, method)


def _lora_layers(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module]]:
    from peft.tuners.lora import LoraLayer

    for name, module in model.named_modules():
        if isinstance(module, LoraLayer) and "default" in module.lora_A:
            yield name.removeprefix(_PREFIX), module


@torch.no_grad()
def adapter_tensors(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The adapter as the engines take it: `<m>.lora_A.weight`, and `<m>.lora_B.weight` scaled by
    alpha / rank, under the base model's HF module names."""
    for name, layer in _lora_layers(model):
        yield f"{name}.lora_A.weight", layer.lora_A["default"].weight.detach()
        yield f"{name}.lora_B.weight", layer.lora_B["default"].weight.detach() * layer.scaling["default"]


@torch.no_grad()
def merged_tensors(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Every base weight under its HF name, with the adapters merged in (what `merge_and_unload`
    gives, without touching the training model)."""
    layers = {f"{name}.weight": layer for name, layer in _lora_layers(model)}
    for name, param in model.named_parameters():
        if ".lora_" in name:
            continue
        hf = name.removeprefix(_PREFIX).replace(".base_layer.", ".")
        layer = layers.get(hf)  # each delta made when its weight is: one at a time in memory
        yield hf, param.detach() if layer is None else param.detach() + layer.get_delta_weight("default").to(param.dtype)


def save_adapter(model: torch.nn.Module, out: Path) -> None:
    """The adapter in `peft`'s own format (`adapter_config.json`, `adapter_model.safetensors`),
    loadable with `PeftModel.from_pretrained(base, out)`."""
    model.save_pretrained(str(out))


def load_adapter(model: torch.nn.Module, adapter_dir: Path, cfg: Config) -> None:
    """Put the adapter `save_adapter` wrote (a checkpoint's `adapter/`) into the `peft` model
    `apply_lora` built from `cfg`; raises ValueError naming the key when the checkpoint's adapter
    has another shape than `trainer.policy.model.lora` asks for."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    saved = json.loads((adapter_dir / "adapter_config.json").read_text())
    lora = cfg.trainer.policy.model.lora
    for key, name, want in (("r", "rank", lora.rank), ("lora_alpha", "alpha", lora.alpha)):
        if saved.get(key) != want:
            raise ValueError(f"the checkpoint's adapter ({adapter_dir}) has {key}={saved.get(key)}, but "
                             f"trainer.policy.model.lora.{name}={want}: resume with the run's LoRA settings")
    result = set_peft_model_state_dict(model, load_file(str(adapter_dir / "adapter_model.safetensors")))
    missing = [key for key in result.missing_keys if ".lora_" in key]
    if result.unexpected_keys or missing:
        raise ValueError(f"the checkpoint's adapter ({adapter_dir}) does not adapt the modules this policy adapts "
                         f"(trainer.policy.model.lora.target_modules): unexpected {result.unexpected_keys[:3]}, "
                         f"missing {missing[:3]}")
