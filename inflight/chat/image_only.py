"""A vision-language model's Hugging Face processor without its video part, for when transformers
cannot build the video processor (it needs torchvision, which is not installed).

transformers 5's processors for the Qwen-VL families (`Qwen2VLProcessor`, `Qwen2_5_VLProcessor`,
`Qwen3VLProcessor`) take an image processor, a tokenizer and a video processor; `AutoProcessor` loads
all three, and the video processor's class needs torchvision. `image_only(family)` is the family's
own class with the video processor left out of its sub-processors, so transformers' `from_pretrained`
loads the rest from the model directory as it would (the tokenizer, the image processor through
`AutoImageProcessor`, which picks the PIL backend without torchvision, and the chat template), and
the processor's `__call__` (placeholder expansion, `pixel_values`, `image_grid_thw`) is the family's.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

from transformers.models.qwen2_5_vl.processing_qwen2_5_vl import Qwen2_5_VLProcessor
from transformers.processing_utils import ProcessorMixin

FAMILY_ATTRIBUTES = ["image_processor", "tokenizer", "video_processor"]
"""The sub-processors, in the constructor's order, of a family `image_only` can strip of its video."""


class _WithoutVideo:
    """Mixed in before a processor family: its sub-processors are the image processor and the tokenizer
    (transformers reads them from this `__init__`'s parameters); the family's `__init__` still sets its
    token attributes, with no video processor."""

    family: type[ProcessorMixin]

    def __init__(self, image_processor: Any = None, tokenizer: Any = None, chat_template: Any = None,
                 **kwargs: Any) -> None:
        # the family passes (image_processor, tokenizer, video_processor) on to ProcessorMixin, which
        # pairs them with this class's two sub-processors: the missing video processor drops out
        self.family.__init__(self, image_processor, tokenizer, None, chat_template=chat_template)

    def to_dict(self) -> dict[str, Any]:
        """The family's name as `processor_class`: a saved directory loads with AutoProcessor where
        torchvision is installed."""
        return {**super().to_dict(), "processor_class": self.family.__name__}


@cache
def image_only(family: type[ProcessorMixin]) -> type[ProcessorMixin]:
    """`family` (a transformers processor class) without its video processor. Raises ValueError for
    a processor whose sub-processors are not an image processor, a tokenizer and a video processor."""
    if family.get_attributes() != FAMILY_ATTRIBUTES:
        raise ValueError(f"{family.__name__} has the sub-processors {family.get_attributes()}, not "
                         f"{FAMILY_ATTRIBUTES}: no image-only variant of it")
    return type(f"ImageOnly{family.__name__}", (_WithoutVideo, family), {"family": family, "__doc__": (
        f"transformers' {family.__name__} without its video processor (see inflight.chat.image_only).")})


ImageOnlyProcessor = image_only(Qwen2_5_VLProcessor)
"""transformers' Qwen2.5-VL processor without its video processor."""


def family_of(config: Any) -> type[ProcessorMixin]:
    """The transformers processor class of a model config's type (AutoProcessor's own mapping).
    Raises ValueError when transformers maps none."""
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING

    try:
        return PROCESSOR_MAPPING[type(config)]
    except KeyError:
        raise ValueError(f"transformers has no processor class for {type(config).__name__}") from None


def load_image_only(model_dir: str | Path, config: Any) -> ProcessorMixin:
    """The image-only processor of a model directory (whose `config` is given), from its files."""
    return image_only(family_of(config)).from_pretrained(model_dir)


__all__ = ["ImageOnlyProcessor", "family_of", "image_only", "load_image_only"]
