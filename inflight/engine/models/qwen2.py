"""Qwen2 family: q/k/v projections with bias, no qk-norm."""

from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding

from inflight.engine.models.common import ArchSpec, DecoderForCausalLM


class Qwen2ForCausalLM(DecoderForCausalLM):
    spec = ArchSpec(qk_norm=False, rotary_class=Qwen2RotaryEmbedding)
