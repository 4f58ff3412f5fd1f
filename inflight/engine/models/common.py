"""A decoder-only transformer over the paged KV cache, shared by the Qwen2, Qwen3 and Llama families and
their mixture-of-experts variants (the sparse MLP block is `models/moe.py`'s).

Parameter names equal the Hugging Face ones (`model.layers.0.self_attn.q_proj.weight`, ...), so a
checkpoint or a weight update in HF names maps onto `named_parameters()` directly. The numerics follow
`transformers` (RMSNorm in float32, rotary tables from the model's own rope-init function).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.activations import ACT2FN

from inflight.engine.attention import AttentionMetadata, paged_attention, paged_attention_qkv
from inflight.engine.errors import WeightUpdateError
from inflight.engine.kv_cache import KVCache
from inflight.engine.models.layer_ops import TorchOps
from inflight.engine.models.linear import FusedLinear, PackedLinear, packed_linears
from inflight.engine.multimodal import VisionSpec
from inflight.engine.weight_copy import WeightPiece, copy_weight


@dataclass
class PartialWeight:
    """A parameter whose first pieces have landed: where they went and how many elements so far.
    `spare`: `dest` is a spare buffer swapped in once the last piece lands (rollback keeps the
    parameter's storage), not the parameter's own storage."""

    name: str
    dest: torch.Tensor
    filled: int
    spare: bool


@dataclass(frozen=True)
class ArchSpec:
    """What distinguishes one family from another."""

    qk_norm: bool  # per-head RMSNorm on q and k before rotary (Qwen3)
    rotary_class: type  # the family's HF rotary-embedding module, used only to compute inv_freq
    # the mixture-of-experts MLP (models/moe.py) of the layers its `used_at(config, layer)` picks; None: dense
    sparse_block: type | None = None


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return TorchOps.rms_norm(x, self.weight, self.eps)


@dataclass
class ForwardContext:
    """What every layer of one forward shares."""

    ops: TorchOps
    positions: torch.Tensor  # [T] int64
    cos_sin: torch.Tensor  # the rotary table [max_pos, 2, head_dim], float32
    meta: AttentionMetadata
    # the C kernels do every elementwise step and all of attention (a decode step): layers hand
    # them pointers into their fused matmul outputs instead of making views
    native_step: bool = False
    # [T, num_moe_layers, top_k]: each MoE layer writes the experts it chose per token (None: not asked)
    routing: torch.Tensor | None = None


class Attention(nn.Module):
    def __init__(self, config: PretrainedConfig, spec: ArchSpec) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.scale = self.head_dim**-0.5
        qkv_bias = getattr(config, "attention_bias", None)
        # Qwen2 configs do not carry the flag: q/k/v have biases (Qwen2-MoE: `qkv_bias`), o none
        if qkv_bias is None:
            qkv_bias, o_bias = bool(getattr(config, "qkv_bias", True)), False
        else:
            o_bias = qkv_bias
        hidden = config.hidden_size
        self.q_proj = PackedLinear(hidden, self.num_heads * self.head_dim, bias=qkv_bias)
        self.k_proj = PackedLinear(hidden, self.num_kv_heads * self.head_dim, bias=qkv_bias)
        self.v_proj = PackedLinear(hidden, self.num_kv_heads * self.head_dim, bias=qkv_bias)
        self.o_proj = PackedLinear(self.num_heads * self.head_dim, hidden, bias=o_bias)
        if spec.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.qk_norm = spec.qk_norm
        self.qkv = FusedLinear([self.q_proj, self.k_proj, self.v_proj])
        self.fused_linears = (self.qkv,)  # a plain tuple: not submodules, the parameters stay q/k/v's

    def forward(
        self, x: torch.Tensor, ctx: ForwardContext, k_cache: torch.Tensor, v_cache: torch.Tensor
    ) -> torch.Tensor:
        n, ops, heads, kv_heads, dim = x.shape[0], ctx.ops, self.num_heads, self.num_kv_heads, self.head_dim
        fused = None if self.qk_norm else self.qkv.matrix(x)
        if fused is not None and ctx.native_step:
            ops.rotary_columns(fused, heads + kv_heads, ctx.cos_sin, ctx.positions)
            out = paged_attention_qkv(fused, heads, kv_heads, dim, k_cache, v_cache, ctx.meta, self.scale)
            return self.o_proj.forward(out)
        if fused is not None:  # q|k side by side: one rotary call over all their heads
            qk = ops.rotary(
                fused[:, : (heads + kv_heads) * dim].view(n, heads + kv_heads, dim),
                ctx.cos_sin,
                ctx.positions,
            )
            q, k = qk[:, :heads], qk[:, heads:]
            v = fused[:, (heads + kv_heads) * dim :].view(n, kv_heads, dim)
        else:
            q, k, v = self.qkv(x)
            q, k, v = q.view(n, heads, dim), k.view(n, kv_heads, dim), v.view(n, kv_heads, dim)
            if self.qk_norm:
                q = ops.rms_norm(q, self.q_norm.weight, self.q_norm.eps)
                k = ops.rms_norm(k, self.k_norm.weight, self.k_norm.eps)
            q = ops.rotary(q, ctx.cos_sin, ctx.positions)
            k = ops.rotary(k, ctx.cos_sin, ctx.positions)
        out = paged_attention(q, k, v, k_cache, v_cache, ctx.meta, self.scale)
        return self.o_proj.forward(out.reshape(n, -1))


class MLP(nn.Module):
    """gate/up/down projections (SwiGLU unless `hidden_act` says otherwise); `intermediate_size`
    overrides the config's (an expert's or a shared expert's width)."""

    def __init__(self, config: PretrainedConfig, intermediate_size: int | None = None) -> None:
        super().__init__()
        bias = bool(getattr(config, "mlp_bias", False))
        width = config.intermediate_size if intermediate_size is None else intermediate_size
        self.gate_proj = PackedLinear(config.hidden_size, width, bias=bias)
        self.up_proj = PackedLinear(config.hidden_size, width, bias=bias)
        self.down_proj = PackedLinear(width, config.hidden_size, bias=bias)
        self.act = None if config.hidden_act in ("silu", "swish") else ACT2FN[config.hidden_act]
        self.gate_up = FusedLinear([self.gate_proj, self.up_proj])
        self.fused_linears = (self.gate_up,)

    def forward(self, x: torch.Tensor, ops: TorchOps) -> torch.Tensor:
        if self.act is not None:  # not SwiGLU: no fused kernel
            return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))
        fused = self.gate_up.matrix(x)
        if fused is not None:  # silu * up straight from the fused matrix's halves
            return self.down_proj.forward(ops.silu_mul_halves(fused))
        return self.down_proj.forward(ops.silu_mul(*self.gate_up(x)))


class DecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, spec: ArchSpec, moe_index: int | None = None) -> None:
        """`moe_index`: this layer's place among the MoE layers (its MLP is then `spec.sparse_block`)."""
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, spec)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.sparse = moe_index is not None
        self.mlp = spec.sparse_block(config, moe_index) if moe_index is not None else MLP(config)

    def forward(
        self, residual, normed, ctx: ForwardContext, k_cache, v_cache, next_norm: RMSNorm
    ) -> torch.Tensor:
        """`residual` is the stream (updated in place), `normed` its input_layernorm; returns the
        stream after this layer normalised by `next_norm` (the next layer's input norm, or the final)."""
        ops = ctx.ops
        # .forward directly, here and below: Module.__call__ costs microseconds per call, and a
        # decode step makes a few hundred of these calls (no hooks are ever registered on them)
        attn = self.self_attn.forward(normed, ctx, k_cache, v_cache)
        post = self.post_attention_layernorm
        normed = ops.add_rms_norm(residual, attn, post.weight, post.eps)
        mlp = self.mlp.forward(normed, ctx) if self.sparse else self.mlp.forward(normed, ops)
        return ops.add_rms_norm(residual, mlp, next_norm.weight, next_norm.eps)


class Backbone(nn.Module):
    def __init__(self, config: PretrainedConfig, spec: ArchSpec) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        block = spec.sparse_block
        sparse = [block is not None and block.used_at(config, i) for i in range(config.num_hidden_layers)]
        moe_index = [sum(sparse[:i]) if s else None for i, s in enumerate(sparse)]
        self.layers = nn.ModuleList(DecoderLayer(config, spec, m) for m in moe_index)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class DecoderForCausalLM(nn.Module):
    """Base of every supported family; subclasses set `spec`."""

    spec: ClassVar[ArchSpec]

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.config = config
        self.model = Backbone(config, self.spec)
        self.lm_head = PackedLinear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.head_dim = self.model.layers[0].self_attn.head_dim
        self.moe_blocks = [layer.mlp for layer in self.model.layers if layer.sparse]
        # each layer with the norm its output goes through (the next layer's input norm, or the
        # final norm), listed once: indexing the ModuleList costs microseconds per layer and step
        layers = list(self.model.layers)
        nexts = [layer.input_layernorm for layer in layers[1:]] + [self.model.norm]
        self.layer_pairs: list[tuple[DecoderLayer, RMSNorm]] = list(zip(layers, nexts, strict=True))
        self.cos_sin: torch.Tensor | None = None  # [max_pos, 2, head_dim] float32, not a parameter
        self.ops: TorchOps = TorchOps()
        # what the model's images must be like (vision-language models); None: text-only, images refused
        self.vision: VisionSpec | None = None
        # made once: the module tree and the Parameter objects never change after __init__ (updates,
        # sleep and wake replace a parameter's .data); walking them cost ~3 ms per update chunk
        self._by_name: dict[str, nn.Parameter] | None = None
        self._derived: list[PackedLinear | FusedLinear] | None = None

    def init_rotary(self, device: torch.device) -> None:
        """Precompute the cos/sin table with the family's own HF rope-init function."""
        rotary = self.spec.rotary_class(self.config)
        positions = torch.arange(self.config.max_position_embeddings, dtype=torch.float32)
        freqs = positions[:, None] * rotary.inv_freq.float()[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        scaling = rotary.attention_scaling
        self.cos_sin = torch.stack((emb.cos() * scaling, emb.sin() * scaling), dim=1).to(device)

    @property
    def routing_shape(self) -> tuple[int, int] | None:
        """(MoE layers, experts per token) of the routing a forward records; None for a dense model."""
        if not self.moe_blocks:
            return None
        return len(self.moe_blocks), self.moe_blocks[0].top_k

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta,
        kv: KVCache,
        routing: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The final-normed hidden states of the tokens; with `routing` ([T, *routing_shape]), each
        MoE layer also writes there the experts it chose for each token."""
        return self.run_layers(
            self.model.embed_tokens.forward(input_ids), positions, self.cos_sin, meta, kv, routing
        )

    def run_layers(
        self, residual: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, meta, kv: KVCache,
        routing: torch.Tensor | None = None, deepstack: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """The decoder over input embeddings `residual` (updated in place): row i is rotated by
        `cos_sin[positions[i]]`. `deepstack` (rows [R], features [L, R, hidden]): features[i] is added
        to those rows of the stream after layer i, for the first L layers (Qwen3-VL's DeepStack)."""
        native_step = self.ops.native and meta.native_only
        ctx = ForwardContext(self.ops, positions, cos_sin, meta, native_step, routing)
        layers = self.model.layers
        first = layers[0].input_layernorm
        normed = self.ops.rms_norm(residual, first.weight, first.eps)
        added = 0 if deepstack is None else deepstack[1].shape[0]
        for i, (layer, next_norm) in enumerate(self.layer_pairs):
            k_cache, v_cache = kv.layer(i)
            normed = layer.forward(residual, normed, ctx, k_cache, v_cache, next_norm)
            if i < added:  # the next layer reads the stream with the features added, normed again
                residual.index_add_(0, deepstack[0], deepstack[1][i])
                normed = self.ops.rms_norm(residual, next_norm.weight, next_norm.eps)
        return normed

    def use_ops(self, ops: TorchOps) -> None:
        """The implementation of the elementwise steps (TorchOps, or NativeOps for fused kernels)."""
        self.ops = ops

    def use_packed_linears(self, compute_dtype: torch.dtype | None) -> None:
        """Run every linear layer on oneDNN-packed weights computing in `compute_dtype` (CPU), or on
        plain `F.linear` (None)."""
        for linear in packed_linears(self):
            linear.use_packed(compute_dtype)

    def weights_changed(self) -> None:
        """Drop derived copies of the weights (packed linears); call after any change to them."""
        if self._derived is None:
            self._derived = [
                *packed_linears(self),
                *(f for m in self.modules() for f in getattr(m, "fused_linears", ())),
            ]
        for derived in self._derived:  # what invalidate_packed(self) drops, without the module walk
            derived.invalidate()

    def parameters_by_name(self) -> dict[str, nn.Parameter]:
        """`dict(named_parameters())`, made once (do not modify it)."""
        if self._by_name is None:
            self._by_name = dict(self.named_parameters())
        return self._by_name

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def hf_parameter_names(self) -> set[str]:
        """Names a complete weight update must provide (lm_head is optional when tied)."""
        names = set(self.parameters_by_name())
        if self.tie_word_embeddings:
            names.discard("lm_head.weight")
        return names

    def split_fused(
        self, named_tensors: Iterable[tuple[str, torch.Tensor | WeightPiece]]
    ) -> Iterator[tuple[str, torch.Tensor | WeightPiece]]:
        """HF-named tensors as the parameters take them, lazily: a family whose HF module stores
        several of its parameters in one tensor (MoE experts) splits it here; the rest pass through."""
        return iter(named_tensors)

    def resolve(self, hf_name: str) -> str | None:
        """Map an HF checkpoint name to a parameter name; None for names that carry no parameter."""
        if hf_name.endswith("rotary_emb.inv_freq"):
            return None
        if self.tie_word_embeddings and hf_name == "lm_head.weight":
            return "model.embed_tokens.weight"
        return hf_name

    def copy_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor | WeightPiece]],
        keep_old: dict[str, torch.Tensor] | None = None, spares: dict[str, torch.Tensor] | None = None,
        partial: dict[str, PartialWeight] | None = None,
    ) -> set[str]:
        """Copy HF-named tensors into the parameters (cast to their dtype); returns the names set.

        With `keep_old`, a parameter's first write gives it other storage and files the old storage
        there (no extra copy), so the caller can roll back. That storage is taken from `spares`
        (name -> a tensor of the parameter's shape, dtype and device, popped) where one is there:
        writing into memory already touched costs a memcpy, a fresh allocation page faults at a
        fraction of that speed. A `WeightPiece` is copied straight into its range of that storage;
        `partial` (HF name -> PartialWeight) carries a split parameter from one call to the next,
        and the parameter is set (swapped in) only with its last piece. Raises WeightUpdateError on
        an unknown name, a wrong shape or a piece out of order, before touching that parameter.
        """
        try:
            return self._copy_weights(named_tensors, keep_old, {} if spares is None else spares,
                                      {} if partial is None else partial)
        finally:
            self.weights_changed()

    def _copy_weights(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor | WeightPiece]],
        keep_old: dict[str, torch.Tensor] | None,
        spares: dict[str, torch.Tensor],
        partial: dict[str, PartialWeight],
    ) -> set[str]:
        params = self.parameters_by_name()
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
            if isinstance(tensor, WeightPiece):
                if _copy_piece(hf_name, name, param, tensor, keep_old, spares, partial):
                    loaded.add(name)
                continue
            if keep_old is not None and name not in keep_old:
                fresh = _buffer_like(spares.pop(name, None), param)
                try:
                    copy_weight(fresh, tensor.detach(), hf_name)  # refused: the parameter is untouched
                except WeightUpdateError:
                    spares[name] = fresh
                    raise
                keep_old[name] = param.data
                param.data = fresh
            else:
                copy_weight(param.data, tensor.detach(), hf_name)
            loaded.add(name)
        return loaded


def _copy_piece(
    hf_name: str,
    name: str,
    param: nn.Parameter,
    piece: WeightPiece,
    keep_old: dict[str, torch.Tensor] | None,
    spares: dict[str, torch.Tensor],
    partial: dict[str, PartialWeight],
) -> bool:
    """Copy one piece into its range of the parameter's destination; True once it is complete."""
    entry = partial.get(hf_name)
    filled = 0 if entry is None else entry.filled
    if piece.start != filled or not piece.start < piece.end <= param.numel():
        raise WeightUpdateError(
            f"parameter {hf_name!r}: a piece of elements [{piece.start}, {piece.end}) where elements "
            f"[{filled}, ...) of {param.numel()} come next; pieces of a split tensor arrive in order"
        )
    if entry is None:
        if keep_old is not None and name not in keep_old:  # into a spare: the parameter stays as it is
            entry = PartialWeight(name, _buffer_like(spares.pop(name, None), param), 0, spare=True)
        else:
            entry = PartialWeight(name, param.data, 0, spare=False)
    try:
        copy_weight(entry.dest.view(-1)[piece.start : piece.end], piece.data.detach().reshape(-1), hf_name)
    except WeightUpdateError:
        partial.pop(hf_name, None)
        if entry.spare:
            spares[name] = entry.dest
        raise
    entry.filled = piece.end
    if piece.end < param.numel():
        partial[hf_name] = entry
        return False
    partial.pop(hf_name, None)
    if entry.spare:
        assert keep_old is not None
        keep_old[name] = param.data
        param.data = entry.dest
    return True


def _buffer_like(spare: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """`spare` when it has `like`'s shape, dtype and device, else new contiguous storage."""
    if (
        spare is not None
        and spare.shape == like.shape
        and spare.dtype == like.dtype
        and spare.device == like.device
    ):
        return spare
    return torch.empty(like.shape, dtype=like.dtype, device=like.device)
