"""A decoder-only transformer over the paged KV cache, shared by the Qwen2, Qwen3 and Llama families.

Parameter names equal the Hugging Face ones (`model.layers.0.self_attn.q_proj.weight`, ...), so a
checkpoint or a weight update in HF names maps onto `named_parameters()` directly. The numerics follow
`transformers` (RMSNorm in float32, rotary tables from the model's own rope-init function).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.activations import ACT2FN

from inflight.engine.attention import AttentionMetadata, paged_attention
from inflight.engine.errors import WeightUpdateError
from inflight.engine.kv_cache import KVCache


@dataclass(frozen=True)
class ArchSpec:
    """What distinguishes one family from another."""

    qk_norm: bool  # per-head RMSNorm on q and k before rotary (Qwen3)
    rotary_class: type  # the family's HF rotary-embedding module, used only to compute inv_freq


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    def __init__(self, config: PretrainedConfig, spec: ArchSpec) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.scale = self.head_dim**-0.5
        qkv_bias = getattr(config, "attention_bias", None)
        if qkv_bias is None:  # Qwen2 configs do not carry the flag: q/k/v have biases, o has none
            qkv_bias, o_bias = True, False
        else:
            o_bias = qkv_bias
        hidden = config.hidden_size
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=o_bias)
        if spec.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.qk_norm = spec.qk_norm

    def forward(self, x, cos, sin, meta: AttentionMetadata, k_cache, v_cache) -> torch.Tensor:
        n = x.shape[0]
        q = self.q_proj(x).view(n, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(n, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(n, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        out = paged_attention(q, k, v, k_cache, v_cache, meta, self.scale)
        return self.o_proj(out.reshape(n, -1))


class MLP(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        bias = bool(getattr(config, "mlp_bias", False))
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=bias)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=bias)
        self.act = ACT2FN[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, spec: ArchSpec) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, spec)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, cos, sin, meta, k_cache, v_cache) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, meta, k_cache, v_cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    def __init__(self, config: PretrainedConfig, spec: ArchSpec) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, spec) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class DecoderForCausalLM(nn.Module):
    """Base of every supported family; subclasses set `spec`."""

    spec: ClassVar[ArchSpec]

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.config = config
        self.model = Backbone(config, self.spec)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.head_dim = self.model.layers[0].self_attn.head_dim
        self.cos_sin: torch.Tensor | None = None  # [max_pos, 2, head_dim] float32, not a parameter

    def init_rotary(self, device: torch.device) -> None:
        """Precompute the cos/sin table with the family's own HF rope-init function."""
        rotary = self.spec.rotary_class(self.config)
        positions = torch.arange(self.config.max_position_embeddings, dtype=torch.float32)
        freqs = positions[:, None] * rotary.inv_freq.float()[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        scaling = rotary.attention_scaling
        self.cos_sin = torch.stack((emb.cos() * scaling, emb.sin() * scaling), dim=1).to(device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta, kv: KVCache) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        cos_sin = self.cos_sin[positions].to(x.dtype)
        cos, sin = cos_sin[:, 0, None, :], cos_sin[:, 1, None, :]
        for i, layer in enumerate(self.model.layers):
            k_cache, v_cache = kv.layer(i)
            x = layer(x, cos, sin, meta, k_cache, v_cache)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def hf_parameter_names(self) -> set[str]:
        """Names a complete weight update must provide (lm_head is optional when tied)."""
        names = {name for name, _ in self.named_parameters()}
        if self.tie_word_embeddings:
            names.discard("lm_head.weight")
        return names

    def resolve(self, hf_name: str) -> str | None:
        """Map an HF checkpoint name to a parameter name; None for names that carry no parameter."""
        if hf_name.endswith("rotary_emb.inv_freq"):
            return None
        if self.tie_word_embeddings and hf_name == "lm_head.weight":
            return "model.embed_tokens.weight"
        return hf_name

    def copy_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], keep_old: dict[str, torch.Tensor] | None = None
    ) -> set[str]:
        """Copy HF-named tensors into the parameters (cast to their dtype); returns the names set.

        With `keep_old`, a parameter's first write gives it new storage and files the old storage
        there (no extra copy), so the caller can roll back. Raises WeightUpdateError on an unknown
        name or a wrong shape, before touching that parameter.
        """
        params = dict(self.named_parameters())
        loaded = set()
        for hf_name, tensor in named_tensors:
            name = self.resolve(hf_name)
            if name is None:
                continue
            param = params.get(name)
            if param is None:
                raise WeightUpdateError(f"unknown parameter {hf_name!r} for {type(self).__name__}")
            if tuple(tensor.shape) != tuple(param.shape):
                raise WeightUpdateError(
                    f"parameter {hf_name!r} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}"
                )
            if keep_old is not None and name not in keep_old:
                keep_old[name] = param.data
                param.data = tensor.detach().to(device=param.device, dtype=param.dtype, copy=True).contiguous()
            else:
                with torch.no_grad():
                    param.copy_(tensor)
            loaded.add(name)
        return loaded
