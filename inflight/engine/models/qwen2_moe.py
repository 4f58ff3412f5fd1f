"""Qwen2-MoE: Qwen2 attention (q/k/v bias per `qkv_bias`) with sparse MoE MLPs plus a gated shared expert."""

from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeRotaryEmbedding

from inflight.engine.models.common import ArchSpec
from inflight.engine.models.moe import MoeForCausalLM, SharedExpertMoeBlock


class Qwen2MoeForCausalLM(MoeForCausalLM):
    spec = ArchSpec(qk_norm=False, rotary_class=Qwen2MoeRotaryEmbedding, sparse_block=SharedExpertMoeBlock)
