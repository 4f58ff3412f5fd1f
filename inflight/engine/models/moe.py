"""The sparse mixture-of-experts MLP of Qwen2-MoE and Qwen3-MoE, and the expert weights' names.

Routing follows transformers' `Qwen3MoeTopKRouter` / `Qwen2MoeTopKRouter`: router logits in the
model's dtype, softmax in float32, `torch.topk` (its order and its ties), renormalised over the
chosen experts only with `norm_topk_prob`, the weights cast back to the model's dtype. Each expert
then runs once over the tokens routed to it (one gather, the expert's packed gate|up and down
matmuls, the routing weight), each (token, slot) output lands in its row, and a token's slots are
summed in slot order: transformers' default `grouped_mm` experts path, whose float32 accumulation
of a bfloat16 sum this repeats. No expert runs over tokens that did not choose it.

Parameters keep the names of published checkpoints (`mlp.experts.{e}.gate_proj.weight`, ...), so each
expert is an `MLP` of packed linears whose copies are dropped with every weight change like any
other. Packing pays at expert shapes as at dense ones (gate|up + down, 1 thread, Zen 5: 2048 x 768
experts 1.2-3.5x faster than F.linear in float32 and 1.1-2.3x in bfloat16 at 1-64 rows; 1024 x 256
1.4-2.3x, except one float32 row at 0.8x), so experts take the same `PackedLinear` rule (plain
F.linear for tiny weights and few rows). transformers 5 holds an MoE layer's experts as two 3-D tensors,
`mlp.experts.gate_up_proj` [E, 2 * I, H] (gate rows, then up rows) and `mlp.experts.down_proj` [E, H, I]: that
is what a trainer's `state_dict()` sends, and `split_expert_tensors` cuts them (whole, or as `WeightPiece`s)
into the per-expert parameters; LoRA adapters on them in peft's layout (`target_parameters`) are cut alike.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch
from torch import nn
from transformers import PretrainedConfig

from inflight.engine.errors import WeightUpdateError
from inflight.engine.models.common import MLP, DecoderForCausalLM, ForwardContext
from inflight.engine.models.layer_ops import TorchOps
from inflight.engine.models.linear import PackedLinear
from inflight.engine.weight_copy import WeightPiece

_FUSED = re.compile(
    r"^(?P<experts>.+\.mlp\.experts)\.(?P<kind>gate_up_proj|down_proj)(?P<lora>\.lora_[AB]\.weight)?$"
)


def routing_dtype(num_experts: int) -> torch.dtype:
    """The integer type a routing record is kept in: uint8 up to 256 experts, else int16."""
    if num_experts > 2**15:
        raise ValueError(f"{num_experts} experts do not fit a routing record (int16); at most {2**15}")
    return torch.uint8 if num_experts <= 256 else torch.int16


class SparseMoeBlock(nn.Module):
    """Router `gate`, experts `experts.{e}`; Qwen2-MoE's subclass adds the gated shared expert."""

    def __init__(self, config: PretrainedConfig, moe_index: int) -> None:
        super().__init__()
        hidden, self.num_experts, self.top_k = (
            config.hidden_size,
            config.num_experts,
            config.num_experts_per_tok,
        )
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok={self.top_k} must be in [1, num_experts={self.num_experts}]"
            )
        self.norm_topk_prob = bool(config.norm_topk_prob)
        self.moe_index = moe_index
        self.gate = PackedLinear(hidden, self.num_experts, bias=False)
        self.experts = nn.ModuleList(
            MLP(config, config.moe_intermediate_size) for _ in range(self.num_experts)
        )
        self.expert_list = list(self.experts)  # indexing a ModuleList costs microseconds per call

    @staticmethod
    def used_at(config: PretrainedConfig, layer: int) -> bool:
        """Whether decoder layer `layer` is sparse: transformers' rule (`mlp_only_layers`,
        `decoder_sparse_step`); the others are dense MLPs of `intermediate_size`."""
        step = getattr(config, "decoder_sparse_step", 1) or 1
        only = getattr(config, "mlp_only_layers", None) or []
        return layer not in only and config.num_experts > 0 and (layer + 1) % step == 0

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(routing weights [T, k] in x's dtype, expert ids [T, k] int64), as transformers' router."""
        logits = self.gate.forward(x)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights /= weights.sum(dim=-1, keepdim=True)
        return weights.to(logits.dtype), ids

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        weights, ids = self.route(x)
        if ctx.routing is not None:
            ctx.routing[:, self.moe_index].copy_(ids)
        return self.run_experts(x, ids, weights, ctx.ops)

    def run_experts(
        self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, ops: TorchOps
    ) -> torch.Tensor:
        """sum over k of weights[t, k] * expert_{ids[t, k]}(x[t]), each expert over its tokens only."""
        tokens, k = ids.shape
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)  # the (token, slot) pairs grouped by expert
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        rows = x.index_select(0, order // k)
        slot_weights = weights.reshape(-1, 1).index_select(0, order)
        out = torch.empty_like(rows)
        start = 0
        for expert, n in enumerate(counts):
            if n:
                end = start + n
                y = self.expert_list[expert].forward(rows[start:end], ops)
                torch.mul(y, slot_weights[start:end], out=out[start:end])
                start = end
        per_slot = torch.empty_like(out).index_copy_(0, order, out)
        return per_slot.view(tokens, k, -1).sum(dim=1)


class SharedExpertMoeBlock(SparseMoeBlock):
    """Qwen2-MoE: the routed experts plus `sigmoid(shared_expert_gate(x)) * shared_expert(x)`."""

    def __init__(self, config: PretrainedConfig, moe_index: int) -> None:
        super().__init__(config, moe_index)
        self.shared_expert = MLP(config, config.shared_expert_intermediate_size)
        self.shared_expert_gate = PackedLinear(config.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        routed = super().forward(x, ctx)
        shared = self.shared_expert.forward(x, ctx.ops)
        return routed + torch.sigmoid(self.shared_expert_gate.forward(x)) * shared


class MoeForCausalLM(DecoderForCausalLM):
    """A decoder whose sparse layers are `spec.sparse_block`; takes transformers 5's fused expert
    tensors (and LoRA adapters on them) besides the per-expert names."""

    def split_fused(
        self, named_tensors: Iterable[tuple[str, torch.Tensor | WeightPiece]]
    ) -> Iterator[tuple[str, torch.Tensor | WeightPiece]]:
        for name, tensor in named_tensors:
            match = _FUSED.match(name)
            if match is None:
                yield name, tensor
            elif match["lora"]:
                yield from self._split_lora(name, match, tensor)
            else:
                yield from self._split_weight(name, match, tensor)

    def _block_at(self, name: str, experts: str) -> SparseMoeBlock:
        """The MoE block whose experts `experts` (`model.layers.{i}.mlp.experts`) names."""
        found = re.fullmatch(r"model\.layers\.(\d+)\.mlp\.experts", experts)
        layers = self.model.layers
        if found is None or int(found[1]) >= len(layers) or not layers[int(found[1])].sparse:
            raise WeightUpdateError(f"unknown parameter {name!r}: the model has no MoE layer {experts!r}")
        return layers[int(found[1])].mlp

    def _targets(
        self, name: str, experts: str, kind: str
    ) -> tuple[tuple[int, ...], list[tuple[str, tuple[int, int]]]]:
        """The fused tensor's shape and the per-expert parameters it holds, in its row-major order."""
        block = self._block_at(name, experts)
        e, hidden = block.num_experts, self.config.hidden_size
        width = block.expert_list[0].gate_proj.out_features
        if kind == "gate_up_proj":
            parts = [
                (f"{experts}.{i}.{p}.weight", (width, hidden))
                for i in range(e)
                for p in ("gate_proj", "up_proj")
            ]
            return (e, 2 * width, hidden), parts
        return (e, hidden, width), [(f"{experts}.{i}.down_proj.weight", (hidden, width)) for i in range(e)]

    def _split_weight(
        self, name: str, match: re.Match, tensor
    ) -> Iterator[tuple[str, torch.Tensor | WeightPiece]]:
        shape, parts = self._targets(name, match["experts"], match["kind"])
        if tuple(tensor.shape) != shape:
            raise WeightUpdateError(f"parameter {name!r} has shape {tuple(tensor.shape)}, expected {shape}")
        if isinstance(tensor, WeightPiece):
            yield from _split_piece(tensor, parts)
            return
        rows = tensor.reshape(-1, shape[-1])  # each part is a run of whole rows
        start = 0
        for part, part_shape in parts:
            yield part, rows[start : start + part_shape[0]]
            start += part_shape[0]

    def _split_lora(self, name: str, match: re.Match, tensor) -> Iterator[tuple[str, torch.Tensor]]:
        """peft's `ParamWrapper` layout for a 3-D expert weight [E, out, in] (`target_parameters`):
        lora_A [E * r, in] (expert e's rows e*r .. e*r+r-1), lora_B [out, E * r] (expert e's
        columns e, e+E, ...); gate_up's A serves gate and up, its B rows split between them."""
        if not isinstance(tensor, torch.Tensor) or tensor.dim() != 2:
            raise WeightUpdateError(f"adapter tensor {name!r} must be a 2-D tensor (peft's layout), got "
                                    f"{type(tensor).__name__} of shape {tuple(getattr(tensor, 'shape', ()))}")
        shape, parts = self._targets(name, match["experts"], match["kind"])
        experts, out_features, in_features = shape
        is_a = match["lora"] == ".lora_A.weight"
        rank_dim, other, want = (0, 1, in_features) if is_a else (1, 0, out_features)
        if tensor.shape[other] != want or tensor.shape[rank_dim] % experts:
            side = f"[{experts} * rank, {in_features}]" if is_a else f"[{out_features}, {experts} * rank]"
            raise WeightUpdateError(
                f"adapter tensor {name!r} has shape {tuple(tensor.shape)}, expected {side}"
            )
        rank = tensor.shape[rank_dim] // experts
        per_expert = (
            tensor.view(experts, rank, in_features) if is_a else tensor.view(out_features, rank, experts)
        )
        suffix = match["lora"]
        per = len(parts) // experts
        for e in range(experts):
            mine = per_expert[e] if is_a else per_expert[:, :, e]
            start = 0
            for part, (rows, _) in parts[e * per : (e + 1) * per]:
                yield part.removesuffix(".weight") + suffix, mine if is_a else mine[start : start + rows]
                start += rows


def _split_piece(
    piece: WeightPiece, parts: list[tuple[str, tuple[int, int]]]
) -> Iterator[tuple[str, WeightPiece]]:
    """The pieces of the parameters that `piece`'s flat element range of the fused tensor covers."""
    offset = 0
    for part, shape in parts:
        numel = shape[0] * shape[1]
        lo, hi = max(piece.start, offset), min(piece.end, offset + numel)
        if lo < hi:
            yield part, WeightPiece(piece.data[lo - piece.start : hi - piece.start], lo - offset, shape)
        offset += numel
