"""LoRA policies through `peft`: the adapter is what trains, what a weight sync sends and what a
checkpoint holds beside the merged model.

`apply_lora` wraps a transformers model in a `peft` LoRA model (`trainer.policy.model.lora.*`): the
base weights are frozen, so the optimizer (built over the parameters that require gradients) holds
only the adapters. `adapter_tensors` is the sync's payload in the engine's naming
(`inflight.engine.adapters`): per adapted layer `<m>.lora_A.weight` and `<m>.lora_B.weight` times
the layer's scaling. `merged_tensors` is the full model with every adapter merged (the HF export).
`save_adapter` and `load_adapter` write and read a checkpoint's adapter in peft's own format.

Mixtures of experts: peft adapts transformers' 3-D expert weights (`mlp.experts.gate_up_proj`,
`down_proj`) and the router's weight (`mlp.gate`) through `ParamWrapper` layers (what `all-linear`
targets there, and `gate_proj`+`up_proj` / `down_proj` / `gate` by name); each is named after the
weight it adapts (`<experts>.gate_up_proj.lora_A.weight`, in peft's [E * rank, in] / [out, E * rank]
layout, which the engine cuts per expert; `<m>.lora_A.weight` for a 2-D weight), whatever wrappers
peft nests (`base_layer`). Targets peft cannot adapt are refused naming
`trainer.policy.model.lora.target_modules`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from inflight.config import Config, ConfigError, Violation

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
    from inflight.train.vision import lora_exclusions

    lora = cfg.trainer.policy.model.lora
    targets = lora.target_modules
    modules, parameters = moe_targets(model, list(targets))
    excluded = [*(lora.exclude_modules or []), *lora_exclusions(model)]  # a vision tower: never adapted
    config = peft.LoraConfig(**{**lora_kwargs(cfg), "target_modules": _peft_targets(modules),
                                "target_parameters": parameters or None, "exclude_modules": excluded or None})
    try:
        adapted = peft.get_peft_model(model, config)
    except ValueError as err:  # peft's own refusals (NoMatchingPeftModuleError is one): name the key
        raise ConfigError(
            [
                Violation(
                    "trainer.policy.model.lora.target_modules",
                    list(targets),
                    f"peft cannot adapt them on {type(model).__name__}: {err}",
                    "name modules the model has (e.g. q_proj,v_proj), or all-linear",
                )
            ]
        ) from err
    _refuse_skipped(adapted, list(targets), excluded)
    return adapted


def lora_kwargs(cfg: Config) -> dict[str, Any]:
    """peft `LoraConfig`'s keyword arguments for `trainer.policy.model.lora` on a dense model (a
    mixture of experts also gets `moe_targets`' parameters), as plain JSON values: what `apply_lora`
    builds, and what `inflight bench peers` hands TRL's side."""
    lora = cfg.trainer.policy.model.lora
    return {"r": lora.rank, "lora_alpha": lora.alpha, "lora_dropout": lora.dropout,
            "target_modules": _peft_targets(list(lora.target_modules)),
            "exclude_modules": list(lora.exclude_modules) if lora.exclude_modules else None,
            "init_lora_weights": init_lora_weights(lora.init_method)}


def _peft_targets(modules: list[str]) -> str | list[str]:
    return "all-linear" if modules == ["all-linear"] else modules


def _refuse_skipped(model: torch.nn.Module, targets: list[str], excluded: list[str]) -> None:
    """ConfigError when peft left a linear module the targets name without an adapter: peft 0.21's
    Qwen3-MoE name conversion moves gate_proj / up_proj / down_proj onto the experts, and the dense
    MLPs of `mlp_only_layers` then get none."""
    from peft.tuners.lora import LoraLayer

    def named(name: str, names: list[str]) -> bool:
        return any(name == n or name.endswith("." + n) for n in names)

    wrapped = {hf_name(n) for n, m in model.named_modules() if isinstance(m, LoraLayer)}
    skipped = [hf for n, m in model.named_modules() if type(m) is torch.nn.Linear and ".lora_" not in n
               and (hf := hf_name(n)) not in wrapped and not hf.endswith("lm_head")
               and (targets == ["all-linear"] or named(hf, targets)) and not named(hf, excluded)]
    if skipped:
        raise ConfigError(
            [
                Violation(
                    "trainer.policy.model.lora.target_modules",
                    targets,
                    f"peft leaves {len(skipped)} "
                    f"of the linear modules they name without an adapter (e.g. {skipped[0]}): its "
                    "mixture-of-experts name conversion moves gate_proj / up_proj / down_proj onto "
                    "the experts",
                    "add those modules to trainer.policy.model.lora.exclude_modules, "
                    "or name the modules to adapt without them",
                )
            ]
        )


_EXPERTS = {
    "gate_up_proj": "mlp.experts.gate_up_proj",
    "down_proj": "mlp.experts.down_proj",
    "gate": "mlp.gate.weight",
}
"""A transformers mixture of experts' weights that are no linear module (its 3-D expert weights, its
router's weight), as peft's `target_parameters`, by the target name that adapts them."""


def moe_targets(model: torch.nn.Module, targets: list[str]) -> tuple[list[str], list[str]]:
    """(target_modules, target_parameters) for peft: on a mixture of experts, `all-linear` also adapts
    the expert weights and the routers (as peft does for Qwen3-MoE, not for Qwen2-MoE), and the
    names `gate_proj`+`up_proj` (or `gate_up_proj`), `down_proj` and `gate` adapt the experts'
    fused gate|up, their down and the routers besides any linear modules so named. ConfigError for
    one of gate_proj / up_proj alone: the experts hold them fused."""
    from inflight.train.moe_replay import moe_routers

    if not moe_routers(model):
        return targets, []
    if targets == ["all-linear"]:
        return targets, list(_EXPERTS.values())
    names = set(targets)
    if len(names & {"gate_proj", "up_proj"}) == 1:
        raise ConfigError(
            [
                Violation(
                    "trainer.policy.model.lora.target_modules",
                    targets,
                    "names one of gate_proj "
                    "and up_proj, which a mixture of experts holds fused (experts.gate_up_proj)",
                    "name both, or neither",
                )
            ]
        )
    if {"gate_proj", "up_proj"} <= names:
        names.add("gate_up_proj")
    parameters = [param for name, param in _EXPERTS.items() if name in names]
    return [t for t in targets if t != "gate_up_proj"], parameters


INIT_METHODS = {"kaiming": True, "gaussian": "gaussian"}
"""SkyRL's `lora.init_method` names as peft's `init_lora_weights` (peft's own names pass through)."""


def init_lora_weights(method: str) -> bool | str:
    """peft's `init_lora_weights` for `trainer.policy.model.lora.init_method`."""
    return INIT_METHODS.get(method, method)


_BASE_LAYER = re.compile(r"\.base_layer(?=\.|$)")


def hf_name(peft_name: str) -> str:
    """A parameter's or module's name in the base model: peft's prefix and `base_layer` wrappers out."""
    return _BASE_LAYER.sub("", peft_name.removeprefix(_PREFIX))


def _lora_layers(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module]]:
    """(HF name of the weight each adapter adapts, its LoRA layer): `<m>.weight` for a linear layer,
    `<m>.<parameter>` for peft's ParamWrapper (an MoE's 3-D expert weights, its router's weight)."""
    from peft.tuners.lora import LoraLayer

    for name, module in model.named_modules():
        if isinstance(module, LoraLayer) and "default" in module.lora_A:
            yield f"{hf_name(name)}.{getattr(module, 'parameter_name', None) or 'weight'}", module


@torch.no_grad()
def adapter_tensors(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The adapter as the engines take it: `<w>.lora_A.weight`, and `<w>.lora_B.weight` scaled by
    alpha / rank, for each adapted weight `<w>` under the base model's HF names (`<m>.weight` is
    written `<m>`)."""
    for weight, layer in _lora_layers(model):
        name = weight.removesuffix(".weight")
        yield f"{name}.lora_A.weight", layer.lora_A["default"].weight.detach()
        yield f"{name}.lora_B.weight", layer.lora_B["default"].weight.detach() * layer.scaling["default"]


@torch.no_grad()
def merged_tensors(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Every base weight under its HF name, with the adapters merged in (what `merge_and_unload`
    gives, without touching the training model)."""
    layers = dict(_lora_layers(model))
    for name, param in model.named_parameters():
        if ".lora_" in name:
            continue
        hf = hf_name(name)
        layer = layers.get(hf)  # each delta made when its weight is: one at a time in memory
        yield (
            hf,
            param.detach()
            if layer is None
            else param.detach() + layer.get_delta_weight("default").to(param.dtype),
        )


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
        raise ValueError(
            f"the checkpoint's adapter ({adapter_dir}) does not adapt the modules this policy adapts "
            f"(trainer.policy.model.lora.target_modules): unexpected {result.unexpected_keys[:3]}, "
            f"missing {missing[:3]}"
        )
