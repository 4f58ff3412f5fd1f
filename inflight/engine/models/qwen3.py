"""Qwen3 family: per-head RMSNorm on queries and keys, explicit head_dim."""

from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

from inflight.engine.models.common import ArchSpec, DecoderForCausalLM


class Qwen3ForCausalLM(DecoderForCausalLM):
    spec = ArchSpec(qk_norm=True, rotary_class=Qwen3RotaryEmbedding)
