"""Qwen3-MoE: Qwen3 attention (qk-norm) with sparse MoE MLPs (no shared expert)."""

from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRotaryEmbedding

from inflight.engine.models.common import ArchSpec
from inflight.engine.models.moe import MoeForCausalLM, SparseMoeBlock


class Qwen3MoeForCausalLM(MoeForCausalLM):
    spec = ArchSpec(qk_norm=True, rotary_class=Qwen3MoeRotaryEmbedding, sparse_block=SparseMoeBlock)
