"""Llama family: optional attention/MLP biases, rope scaling through the HF rope-init functions."""

from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from inflight.engine.models.common import ArchSpec, DecoderForCausalLM


class LlamaForCausalLM(DecoderForCausalLM):
    spec = ArchSpec(qk_norm=False, rotary_class=LlamaRotaryEmbedding)
