"""Hugging Face <-> megatron-core GPTModel: names, fused layouts and tensor-parallel shards.

Pure tensor code (no process groups), so it is tested without spawning ranks. The megatron side is
the local-spec GPTModel (`get_gpt_layer_local_spec`), whose parameters per layer are:

megatron (per TP rank)                       | Hugging Face                            | TP split
-------------------------------------------- | --------------------------------------- | --------
embedding.word_embeddings.weight             | model.embed_tokens.weight               | rows (vocab, padded)
decoder.layers.i.input_layernorm.weight      | model.layers.i.input_layernorm.weight   | replicated
decoder.layers.i.self_attention.linear_qkv.* | model.layers.i.self_attn.{q,k,v}_proj.* | rows, per query group
decoder.layers.i.self_attention.{q,k}_layernorm | model.layers.i.self_attn.{q,k}_norm.weight | replicated
decoder.layers.i.self_attention.linear_proj  | model.layers.i.self_attn.o_proj.weight  | columns
decoder.layers.i.pre_mlp_layernorm.weight    | model.layers.i.post_attention_layernorm | replicated
decoder.layers.i.mlp.linear_fc1.weight       | model.layers.i.mlp.{gate,up}_proj.weight | rows, [gate_r; up_r]
decoder.layers.i.mlp.linear_fc2.weight       | model.layers.i.mlp.down_proj.weight     | columns
decoder.final_layernorm.weight               | model.norm.weight                       | replicated
output_layer.weight (absent when tied)       | lm_head.weight                          | rows (vocab, padded)

Fused QKV: the full tensor is, for each query group g (= KV head g), the g-th group's query heads,
then key head g, then value head g; a TP rank holds a contiguous run of whole groups. Gated MLP:
megatron splits the local fc1 output in two halves (gate, up), so rank r holds
`cat(gate rows of r, up rows of r)`, not a slice of `cat(gate, up)`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor
from transformers import PretrainedConfig

SUPPORTED_MODEL_TYPES = ("qwen2", "qwen3", "llama")


class ConversionError(ValueError):
    """A config or a tensor that the megatron layout cannot represent (names the culprit)."""


@dataclass(frozen=True)
class MegatronLayout:
    """The shapes that decide how HF tensors map onto megatron TP shards."""

    model_type: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    padded_vocab_size: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tp: int

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_hf_config(cls, config: PretrainedConfig, tp: int) -> MegatronLayout:
        """Check that megatron can hold this model with `tp` ranks; raises ConversionError if not."""
        model_type = getattr(config, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConversionError(
                f"model_type {model_type!r} is not supported; supported: {SUPPORTED_MODEL_TYPES}"
            )
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads or config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        if kv_heads % tp or heads % kv_heads:
            raise ConversionError(
                f"num_key_value_heads={kv_heads} must be divisible by tensor_parallel_size={tp} "
                f"and divide num_attention_heads={heads}"
            )
        if config.intermediate_size % tp:
            raise ConversionError(f"intermediate_size={config.intermediate_size} is not divisible by tp={tp}")
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ConversionError(f"hidden_act={config.hidden_act!r}: only silu (SwiGLU) is supported")
        if getattr(config, "mlp_bias", False):
            raise ConversionError("mlp_bias=True is not supported by the megatron conversion")
        rope = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ConversionError(f"rope_type={rope_type!r} is not supported; only the default rotary")
        theta = rope.get("rope_theta", getattr(config, "rope_theta", None))
        if theta is None:
            raise ConversionError("the config carries no rope_theta")
        if model_type == "qwen2":
            qkv_bias = True  # Qwen2: q/k/v always have biases, o_proj none
        else:
            if getattr(config, "attention_bias", False):
                raise ConversionError(f"{model_type} with attention_bias=True (o_proj bias) is not supported")
            qkv_bias = False
        if getattr(config, "use_sliding_window", False):
            raise ConversionError("sliding-window attention is not supported")
        vocab = config.vocab_size
        return cls(model_type=model_type, num_layers=config.num_hidden_layers, hidden_size=config.hidden_size,
                   num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                   ffn_hidden_size=config.intermediate_size, vocab_size=vocab,
                   padded_vocab_size=-(-vocab // tp) * tp,
                   tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)), qkv_bias=qkv_bias,
                   qk_norm=model_type == "qwen3", rms_norm_eps=config.rms_norm_eps, rope_theta=float(theta),
                   max_position_embeddings=config.max_position_embeddings, tp=tp)


# ---- per-parameter rules ------------------------------------------------------------------------
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_REPLICATED_SUFFIXES = {
    "input_layernorm.weight": "input_layernorm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
}
_ROW_PARALLEL_SUFFIXES = {  # megatron RowParallelLinear: split on the input (column) dim
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
}


def megatron_param_names(layout: MegatronLayout) -> list[str]:
    """Every parameter name of the GPTModel this layout builds, in model order."""
    names = ["embedding.word_embeddings.weight"]
    for i in range(layout.num_layers):
        p = f"decoder.layers.{i}."
        names += [p + "input_layernorm.weight", p + "self_attention.linear_proj.weight",
                  p + "self_attention.linear_qkv.weight"]
        if layout.qkv_bias:
            names.append(p + "self_attention.linear_qkv.bias")
        if layout.qk_norm:
            names += [p + "self_attention.q_layernorm.weight", p + "self_attention.k_layernorm.weight"]
        names += [p + "pre_mlp_layernorm.weight", p + "mlp.linear_fc1.weight", p + "mlp.linear_fc2.weight"]
    names.append("decoder.final_layernorm.weight")
    if not layout.tie_word_embeddings:
        names.append("output_layer.weight")
    return names


def is_tensor_parallel(name: str) -> bool:
    """Whether each TP rank holds a different slice of this parameter (else it is replicated)."""
    return not (name.endswith("layernorm.weight"))


def hf_names_for(name: str, layout: MegatronLayout) -> list[str]:
    """The HF tensors that one megatron parameter is made of, in fusion order."""
    if name == "embedding.word_embeddings.weight":
        return ["model.embed_tokens.weight"]
    if name == "output_layer.weight":
        return ["lm_head.weight"]
    if name == "decoder.final_layernorm.weight":
        return ["model.norm.weight"]
    match = _LAYER.match(name)
    if match is None:
        raise ConversionError(f"unknown megatron parameter {name!r}")
    layer, rest = match.groups()
    p = f"model.layers.{layer}."
    if rest in _REPLICATED_SUFFIXES:
        return [p + _REPLICATED_SUFFIXES[rest]]
    if rest in _ROW_PARALLEL_SUFFIXES:
        return [p + _ROW_PARALLEL_SUFFIXES[rest]]
    if rest.startswith("self_attention.linear_qkv."):
        kind = rest.rsplit(".", 1)[1]
        return [p + f"self_attn.{x}_proj.{kind}" for x in ("q", "k", "v")]
    if rest == "mlp.linear_fc1.weight":
        return [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]
    raise ConversionError(f"unknown megatron parameter {name!r}")


# ---- HF -> megatron shard ------------------------------------------------------------------------
def _fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: MegatronLayout) -> torch.Tensor:
    """[q; k; v] in HF order -> megatron's per-group interleaving (works for weights and biases)."""
    g, hd = layout.num_kv_heads, layout.head_dim
    q = q.reshape(g, layout.heads_per_group * hd, *q.shape[1:])
    k = k.reshape(g, hd, *k.shape[1:])
    v = v.reshape(g, hd, *v.shape[1:])
    fused = torch.cat((q, k, v), dim=1)
    return fused.reshape(g * (layout.heads_per_group + 2) * hd, *q.shape[2:])


def _split_qkv(
    fused: torch.Tensor, layout: MegatronLayout
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g, hd, qpg = layout.num_kv_heads, layout.head_dim, layout.heads_per_group
    grouped = fused.reshape(g, (qpg + 2) * hd, *fused.shape[1:])
    q, k, v = torch.split(grouped, [qpg * hd, hd, hd], dim=1)
    rest = fused.shape[1:]
    return q.reshape(g * qpg * hd, *rest), k.reshape(g * hd, *rest), v.reshape(g * hd, *rest)


def _pad_vocab(weight: torch.Tensor, layout: MegatronLayout) -> torch.Tensor:
    extra = layout.padded_vocab_size - weight.shape[0]
    if extra == 0:
        return weight
    return torch.cat((weight, weight.new_zeros(extra, *weight.shape[1:])), dim=0)


def hf_to_megatron_shard(name: str, get_hf: Callable[[str], torch.Tensor], layout: MegatronLayout,
                         tp_rank: int) -> torch.Tensor:
    """The TP-rank-local tensor of megatron parameter `name`, built from HF tensors via `get_hf`."""
    hf = [get_hf(n) for n in hf_names_for(name, layout)]
    tp = layout.tp
    if not is_tensor_parallel(name):
        return hf[0].clone()
    if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        return _pad_vocab(hf[0], layout).chunk(tp, dim=0)[tp_rank].clone()
    if ".linear_qkv." in name:
        return _fuse_qkv(*hf, layout).chunk(tp, dim=0)[tp_rank].clone()
    if name.endswith("linear_fc1.weight"):
        gate, up = (t.chunk(tp, dim=0)[tp_rank] for t in hf)
        return torch.cat((gate, up), dim=0)
    # row parallel (linear_proj, linear_fc2): split the input dimension
    return hf[0].chunk(tp, dim=1)[tp_rank].clone()


def hf_lookup(hf_state: Mapping[str, torch.Tensor]) -> Callable[[str], torch.Tensor]:
    """`get_hf` over a full HF state dict; a missing name raises ConversionError naming it."""

    def get_hf(hf_name: str) -> torch.Tensor:
        if hf_name not in hf_state:
            raise ConversionError(f"the Hugging Face weights lack {hf_name!r}")
        return hf_state[hf_name]

    return get_hf


def hf_to_megatron_shards(hf_state: Mapping[str, torch.Tensor], layout: MegatronLayout,
                          tp_rank: int) -> dict[str, torch.Tensor]:
    """All megatron parameters of one TP rank from a full HF state dict (tied lm_head may be absent)."""
    get_hf = hf_lookup(hf_state)
    return {
        name: hf_to_megatron_shard(name, get_hf, layout, tp_rank) for name in megatron_param_names(layout)
    }


# ---- megatron shards -> HF -----------------------------------------------------------------------
def megatron_shards_to_hf(
    name: str, shards: list[torch.Tensor], layout: MegatronLayout
) -> list[tuple[str, Tensor]]:
    """Merge one parameter's TP shards (rank order) and unfuse it into its HF tensors."""
    hf_names = hf_names_for(name, layout)
    if not is_tensor_parallel(name):
        return [(hf_names[0], shards[0].clone())]
    if len(shards) != layout.tp:
        raise ConversionError(f"{name!r}: got {len(shards)} shards, expected tp={layout.tp}")
    if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        return [(hf_names[0], torch.cat(shards, dim=0)[: layout.vocab_size])]
    if ".linear_qkv." in name:
        return list(zip(hf_names, _split_qkv(torch.cat(shards, dim=0), layout), strict=True))
    if name.endswith("linear_fc1.weight"):
        halves = [s.chunk(2, dim=0) for s in shards]
        gate = torch.cat([h[0] for h in halves], dim=0)
        up = torch.cat([h[1] for h in halves], dim=0)
        return [(hf_names[0], gate), (hf_names[1], up)]
    return [(hf_names[0], torch.cat(shards, dim=1))]


def megatron_to_hf(
    shard_states: list[Mapping[str, Tensor]], layout: MegatronLayout
) -> Iterator[tuple[str, Tensor]]:
    """HF-named full tensors from every TP rank's megatron state dict (index = TP rank)."""
    for name in megatron_param_names(layout):
        yield from megatron_shards_to_hf(name, [state[name] for state in shard_states], layout)
