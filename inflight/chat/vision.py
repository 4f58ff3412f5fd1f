"""A vision-language model's prompts: chat messages with images through the model's Hugging Face
processor, for the server and the data path alike.

The chat template renders each image part as the model's image placeholder (Qwen2-VL's
`<|vision_start|><|image_pad|><|vision_end|>`); the processor then expands every placeholder to as
many image tokens as the image has merged patches and turns the images into the vision tower's
inputs (`pixel_values`, `image_grid_thw`). Nothing here counts tokens itself: the processor does.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from PIL import Image

from inflight.chat.images import ImageLimits, SplitMessages, split_images

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ImagePrompt:
    """A prompt's token ids with its image placeholders expanded, and the processor's image tensors
    (`pixel_values`: patch rows of every image in order; `image_grid_thw`: [images, 3])."""

    token_ids: list[int]
    pixel_values: Any
    image_grid_thw: Any
    images: list[Image.Image] = field(repr=False, default_factory=list)


@dataclass(frozen=True)
class Vision:
    """What turns images into a model's inputs: its `processor` (transformers') and the `limits`
    every image is checked against."""

    processor: Any
    limits: ImageLimits = ImageLimits()

    def split(self, messages: Sequence[Mapping[str, Any]], base_dir: Path | None = None,
              param: str = "messages") -> SplitMessages:
        """The messages' images decoded and checked (ImageError naming the part), and placeholders."""
        return split_images(messages, self.limits, base_dir, param)

    def expand(self, text: str, images: list[Image.Image], add_special_tokens: bool = False) -> ImagePrompt:
        """The token ids of a rendered prompt `text` holding one image placeholder per image, with the
        placeholders expanded, and the images' tensors."""
        out = self.processor(
            text=[text], images=images, return_tensors="pt", add_special_tokens=add_special_tokens
        )
        return ImagePrompt([int(t) for t in out["input_ids"][0]], out["pixel_values"], out["image_grid_thw"],
                           list(images))


def image_processor_of(processor: Any) -> Any | None:
    """The image processor inside a transformers processor (None: a text-only model's tokenizer)."""
    return getattr(processor, "image_processor", None)


def is_vision_language(config: Any) -> bool:
    """Whether a Hugging Face config (object or config.json's mapping) has a vision tower."""
    if isinstance(config, dict):
        return config.get("vision_config") is not None
    return getattr(config, "vision_config", None) is not None


def auto_model_class(config: Any) -> type:
    """transformers' auto class that loads a model of `config`: image-text-to-text for a
    vision-language model, else causal LM."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    return AutoModelForImageTextToText if is_vision_language(config) else AutoModelForCausalLM


def load_vision(model_dir: str | Path, limits: ImageLimits | None = None) -> Vision | None:
    """The `Vision` of a model directory whose config has a vision tower (`vision_config`); None for a
    text-only model. Raises ValueError naming why a vision model's processor cannot be loaded."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    if not is_vision_language(config):
        return None
    return Vision(load_processor(model_dir, config), limits or ImageLimits())


def load_processor(model_dir: str | Path, config: Any) -> Any:
    """A vision-language model's processor: transformers' AutoProcessor, or where that fails without
    torchvision (the video processor needs it), the model family's processor without its video part
    (chat/image_only.py) from the directory's files. Logs which; raises ValueError naming why neither."""
    from transformers import AutoProcessor
    from transformers.utils import is_torchvision_available

    from inflight.chat.image_only import load_image_only

    model = f"{model_dir}: a vision-language model ({type(config).__name__})"
    try:
        processor, why = AutoProcessor.from_pretrained(model_dir), None
    except Exception as err:  # a missing optional package (torchvision), missing processor files
        processor, why = None, f"{type(err).__name__}: {' '.join(str(err).split())}"
    if processor is not None and image_processor_of(processor) is None:
        why = f"it loads no image processor (a {type(processor).__name__})"
    if why is None:
        log.info("%s: processor %s (transformers' AutoProcessor)", model_dir, type(processor).__name__)
        return processor
    if is_torchvision_available():
        raise ValueError(f"{model} whose processor transformers' AutoProcessor cannot load: {why}")
    try:
        processor = load_image_only(model_dir, config)
    except Exception as err:
        raise ValueError(
            f"{model} whose processor neither transformers' AutoProcessor ({why}) nor the "
            f"image-only processor loads without torchvision: {type(err).__name__}: {err}"
        ) from err
    log.warning("%s: processor %s with %s (image-only: no videos; transformers' AutoProcessor needs "
                "torchvision, not installed: %s)", model_dir, type(processor).__name__,
                type(processor.image_processor).__name__, why[:160])
    return processor


__all__ = ["ImagePrompt", "Vision", "auto_model_class", "image_processor_of", "is_vision_language",
           "load_processor", "load_vision"]
