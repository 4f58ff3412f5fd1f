"""Vision-language policies (Qwen2.5-VL through transformers' `AutoModelForImageTextToText`): what of
the model the training forward calls, the images it is given, and the vision tower that stays frozen.

A batch's rows carry their images (`TrainBatch.pixel_values` / `image_grid_thw`); the forward gives
the model every row's images in row order with `mm_token_type_ids` (1 on the image placeholder
tokens), from which it computes the multimodal rotary positions (M-RoPE) itself, as its own
`generate` does. The chunked log-probabilities need the language model's final hidden states: for a
vision-language model that is the whole base model (`model.model`: vision tower, merged image
embeddings, positions, decoder), not `get_decoder()`, which is the text decoder alone and would take
the placeholders for text.

`trainer.policy.model.freeze_vision_tower` (default true): the tower's parameters get no gradient
(full fine-tuning) and no adapters (LoRA: `lora_exclusions`). A full-weight sync sends them whether
they train or not (an engine takes a full update only complete); a LoRA sync sends the adapter.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch

from inflight.chat.vision import is_vision_language
from inflight.config import Config, ConfigError, Violation
from inflight.train.strategies import strategy_entry

log = logging.getLogger(__name__)

FREEZE_KEY = "trainer.policy.model.freeze_vision_tower"
TOWER_NAMES = ("visual",)
"""Attribute of a transformers vision-language base model holding its vision tower (and the merger
into the language model): Qwen2-VL, Qwen2.5-VL, Qwen3-VL."""


def vision_tower(model: torch.nn.Module) -> torch.nn.Module | None:
    """The vision tower of a transformers vision-language model (inside a peft model too), or None."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    inner = getattr(base, "model", None)
    for name in TOWER_NAMES:
        tower = getattr(inner, name, None)
        if isinstance(tower, torch.nn.Module):
            return tower
    return None


def freezes_tower(cfg: Config, role: str) -> bool:
    """Whether the `role` model's vision tower is frozen: the policy's per `freeze_vision_tower`, the
    reference's always (it never trains)."""
    return role != "policy" or cfg.trainer.policy.model.freeze_vision_tower


def freeze_tower(model: torch.nn.Module) -> int:
    """Every parameter of `model`'s vision tower without gradient; returns how many there were."""
    tower = vision_tower(model)
    if tower is None:
        return 0
    params = list(tower.parameters())
    for param in params:
        param.requires_grad_(False)
    return len(params)


def tower_prefix(model: torch.nn.Module) -> str | None:
    """The HF-name prefix of the vision tower's parameters (`model.visual.`), or None."""
    tower = vision_tower(model)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if tower is None:
        return None
    return next(f"{name}." for name, module in base.named_modules() if module is tower)


def lora_exclusions(model: torch.nn.Module) -> list[str]:
    """The vision tower's module names (full, as peft's `exclude_modules` matches them), so LoRA
    adapts the language model only."""
    prefix, tower = tower_prefix(model), vision_tower(model)
    return [] if tower is None else [f"{prefix}{name}" for name, _ in tower.named_modules() if name]


def hidden_trunk(lm: torch.nn.Module) -> torch.nn.Module:
    """The module whose `last_hidden_state` the LM head reads: the base model of a vision-language
    model (it merges the image embeddings and computes M-RoPE), the decoder of a text one."""
    return lm.model if is_vision_language(lm.config) else lm.get_decoder()


def image_inputs(
    lm: torch.nn.Module, input_ids: torch.Tensor, images: tuple[torch.Tensor, torch.Tensor] | None
) -> dict[str, torch.Tensor]:
    """The forward's image arguments for rows `input_ids` with `images` (`TrainBatch.images`): pixel
    values, grids and `mm_token_type_ids` (1 on image placeholders), which transformers needs to
    compute M-RoPE; {} without images. ValueError for images given to a text-only model."""
    if images is None:
        return {}
    if not is_vision_language(lm.config):
        raise ValueError(f"the batch has images but the policy ({type(lm).__name__}) is text-only: train a "
                         "vision-language model (e.g. Qwen2.5-VL), or leave the images out of the rollouts")
    pixel_values, grids = images
    token_types = input_ids.eq(lm.config.image_token_id).int()
    return {"pixel_values": pixel_values, "image_grid_thw": grids, "mm_token_type_ids": token_types}


_told: set[str] = set()


def tell_once(message: str) -> None:
    """Log `message` once per process (a reason that holds for every micro-batch of a run)."""
    if message not in _told:
        _told.add(message)
        log.info(message)


def check_vision_settings(cfg: Config, model_dir: str | Path, kind: str) -> list[Violation]:
    """What `cfg` asks of a vision-language policy in `model_dir` that the `kind` worker cannot do:
    LoRA with the vision tower training (adapters and engines hold the language model's only), the
    Megatron worker (its conversion holds text models only). [] for a text-only model."""
    path = Path(model_dir) / "config.json"
    if not path.is_file() or not is_vision_language(json.loads(path.read_text())):
        return []
    out = []
    if cfg.trainer.policy.model.lora.rank > 0 and not cfg.trainer.policy.model.freeze_vision_tower:
        out.append(
            Violation(
                FREEZE_KEY,
                False,
                "LoRA adapts the language model only: a vision tower training beside "
                "the adapters would need the engines to take full vision weights with an adapter",
                f"set {FREEZE_KEY}=true, or lora.rank=0 (full fine-tuning trains the tower)",
            )
        )
    refusal = strategy_entry(kind).vision_refusal
    if refusal:
        out.append(Violation("trainer.strategy", cfg.trainer.strategy, f"{refusal}; "
                             f"{model_dir} is a vision-language model", "use trainer.strategy=fsdp"))
    return out


def raise_vision_settings(cfg: Config, model_dir: str | Path, kind: str) -> None:
    """`check_vision_settings` as a ConfigError."""
    problems = check_vision_settings(cfg, model_dir, kind)
    if problems:
        raise ConfigError(problems)


VLM_KEY = "generator.vision_language_generator"


def data_vision(cfg: Config) -> Any:
    """The policy's image processor (`inflight.chat.vision.Vision`) for the data task when it is a
    vision-language model, else None. Raises ValueError naming why a vision model's processor
    cannot be loaded."""
    from inflight.chat.vision import load_vision

    return load_vision(cfg.trainer.policy.model.path)


def check_image_rows(cfg: Config, problems: Any) -> None:
    """Refuse data rows holding images unless `generator.vision_language_generator=true` (SkyRL's
    switch to its vision-language generator: its text generator would render the images away)."""
    from inflight.chat.images import count_images

    if cfg.generator.vision_language_generator:
        return
    with_images = [p for p in problems if not isinstance(p.prompt, str) and count_images(p.prompt)]
    if with_images:
        raise ConfigError(
            [
                Violation(
                    VLM_KEY,
                    False,
                    f"is off, but {len(with_images)} data rows hold images (e.g. "
                    f"{with_images[0].meta.get('source', with_images[0].id)})",
                    f"set {VLM_KEY}=true (SkyRL's vision-language generator), or drop the images",
                )
            ]
        )


__all__ = [
    "FREEZE_KEY",
    "VLM_KEY",
    "check_image_rows",
    "check_vision_settings",
    "data_vision",
    "freeze_tower",
    "freezes_tower",
    "hidden_trunk",
    "image_inputs",
    "is_vision_language",
    "lora_exclusions",
    "raise_vision_settings",
    "tell_once",
    "tower_prefix",
    "vision_tower",
]
