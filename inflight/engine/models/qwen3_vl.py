"""Qwen3-VL (dense): transformers' own vision tower (learned position grid, DeepStack features from
`deepstack_visual_indexes`), a Qwen3 decoder (q/k norms, explicit head_dim), interleaved M-RoPE. The
shared part: `vision_language.py`."""

from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding, Qwen3VLVisionModel

from inflight.engine.models.common import ArchSpec
from inflight.engine.models.vision_language import VisionLanguageModel


class Qwen3VLForConditionalGeneration(VisionLanguageModel):
    spec = ArchSpec(qk_norm=True, rotary_class=Qwen3VLTextRotaryEmbedding)
    vision_tower = Qwen3VLVisionModel
    interleaved_mrope = True
