"""Qwen2.5-VL (dense): transformers' own vision tower (windowed attention), a Qwen2 decoder (q/k/v
biases, no q/k norms), M-RoPE in contiguous column blocks. The shared part: `vision_language.py`."""

from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
    Qwen2_5_VisionTransformerPretrainedModel,
    Qwen2_5_VLRotaryEmbedding,
)

from inflight.engine.models.common import ArchSpec
from inflight.engine.models.vision_language import VisionLanguageModel


class Qwen2_5_VLForConditionalGeneration(VisionLanguageModel):
    spec = ArchSpec(qk_norm=False, rotary_class=Qwen2_5_VLRotaryEmbedding)
    vision_tower = Qwen2_5_VisionTransformerPretrainedModel
