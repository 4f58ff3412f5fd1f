"""LoRA on the megatron GPTModel: SkyRL's `lora_type: lora` (megatron-bridge's), one adapter per
parallel linear layer (`linear_qkv`, `linear_proj`, `linear_fc1`, `linear_fc2` for `all-linear`).

The fused layers keep their fusion: `linear_qkv`'s adapter has one A for q, k and v and one B over the
fused [q; k; v] rows, so in Hugging Face terms q_proj, k_proj and v_proj share their A (likewise
gate_proj and up_proj under `linear_fc1`). The adapters follow their layer's tensor parallelism: on a
column-parallel layer A is whole on every rank and B holds this rank's output rows; on a row-parallel
one A holds this rank's input columns and B is whole. `LoraAdapter` adds `B(A(x)) * alpha / rank` to
its layer's output through a forward hook, so the base parameters keep their megatron names (and the
conversion table), and the adapters are `<layer>.lora.A` / `<layer>.lora.B`, float32 whatever the
base's dtype (as peft keeps them).

peft (0.22) has no working megatron-core layer (its `LoraParallelLinear` misses megatron's
(output, bias) return and its own `lora_bias` bookkeeping), hence this module; the adapters'
Hugging Face form (`hf_adapter`) is peft's, and tests hold the forward and gradients to peft's on the
transformers model.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from inflight.config import Config, ConfigError, Violation
from inflight.megatron.convert import MegatronLayout, hf_names_for, hf_to_megatron_shard

ALL_LINEAR = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
"""The megatron layers `target_modules: [all-linear]` adapts (SkyRL's megatron worker's list)."""
_COLUMN_PARALLEL = ("linear_qkv", "linear_fc1")
_TARGETS = "trainer.policy.model.lora.target_modules"


class LoraAdapter(nn.Module):
    """The adapter of one megatron parallel linear layer (`column`: its output is split over the TP
    ranks; else its input). `forward(x)` is what it adds to the layer's output."""

    def __init__(self, base: nn.Module, rank: int, alpha: float, dropout: float, column: bool) -> None:
        super().__init__()
        out_local, in_local = base.weight.shape
        self.column, self.scaling = column, alpha / rank
        self.A = nn.Parameter(torch.zeros(rank, in_local, dtype=torch.float32, device=base.weight.device))
        self.B = nn.Parameter(torch.zeros(out_local, rank, dtype=torch.float32, device=base.weight.device))
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from megatron.core import tensor_parallel
        from megatron.core.tensor_parallel import mappings

        x = x.float()
        if self.column:  # x is whole on every rank: so is A's output; its gradient sums B's over ranks
            low = mappings.copy_to_tensor_model_parallel_region(F.linear(self.dropout(x), self.A))
        else:  # x is this rank's slice (dropout forked, as megatron drops split activations)
            with tensor_parallel.get_cuda_rng_tracker().fork():
                x = self.dropout(x)
            low = mappings.reduce_from_tensor_model_parallel_region(F.linear(x, self.A))
        return F.linear(low, self.B) * self.scaling

    def delta_weight(self) -> torch.Tensor:
        """This rank's slice of `B @ A * scaling`, shaped as the layer's weight shard."""
        return self.B @ self.A * self.scaling


def _add_output(module: nn.Module, args: tuple, output: tuple) -> tuple:
    out, bias = output
    return (out + module.lora(args[0])).to(out.dtype), bias  # added in float32, rounded once


def target_layers(cfg: Config) -> list[str]:
    """The megatron layer names `trainer.policy.model.lora.target_modules` asks for, less
    `exclude_modules`; ConfigError for a name no GPTModel layer has."""
    lora = cfg.trainer.policy.model.lora
    targets = list(lora.target_modules)
    names = list(ALL_LINEAR) if targets == ["all-linear"] else targets
    unknown = [n for n in names if n not in ALL_LINEAR]
    if unknown:
        raise ConfigError(
            [
                Violation(
                    _TARGETS,
                    targets,
                    f"names {unknown}, which are no layers of megatron's "
                    "GPTModel (with trainer.strategy=megatron the targets are megatron's layer "
                    "names, as in SkyRL)",
                    f"use all-linear or some of {', '.join(ALL_LINEAR)}",
                )
            ]
        )
    return [n for n in names if n not in (lora.exclude_modules or [])]


def add_adapters(model: nn.Module, cfg: Config, tp: int, tp_rank: int) -> dict[str, LoraAdapter]:
    """Freeze `model` and give each target layer an adapter (A initialised per
    `lora.init_method` from `trainer.seed` as one whole matrix, so every rank holds the same one or
    its own slice of it; B zero); returns {layer name: adapter}."""
    lora = cfg.trainer.policy.model.lora
    init = _A_INIT.get(lora.init_method)
    if init is None:
        raise ConfigError(
            [
                Violation(
                    "trainer.policy.model.lora.init_method",
                    lora.init_method,
                    "is not one the megatron adapters take",
                    f"use one of {', '.join(_A_INIT)}",
                )
            ]
        )
    targets = target_layers(cfg)
    for param in model.parameters():
        param.requires_grad_(False)
    generator = torch.Generator().manual_seed(cfg.trainer.seed)
    adapters = {}
    for name, module in model.named_modules():
        kind = name.rsplit(".", 1)[-1]
        if kind not in targets:
            continue
        adapter = LoraAdapter(module, lora.rank, lora.alpha, lora.dropout, kind in _COLUMN_PARALLEL)
        whole = torch.empty(lora.rank, adapter.A.shape[1] * (1 if adapter.column else tp))
        init(whole, lora.rank, generator)
        with torch.no_grad():
            adapter.A.copy_(whole if adapter.column else whole.chunk(tp, dim=1)[tp_rank])
        module.lora = adapter
        module.register_forward_hook(_add_output)
        adapters[name] = adapter
    return adapters


_A_INIT: dict[str, Callable[[torch.Tensor, int, torch.Generator], object]] = {
    "kaiming": lambda a, rank, gen: nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=gen),  # peft's True
    "gaussian": lambda a, rank, gen: nn.init.normal_(a, std=1 / rank, generator=gen),  # peft's "gaussian"
}


@dataclass(frozen=True)
class HfAdapterPart:
    """One adapted Hugging Face module of a megatron adapter: `module` (e.g.
    `model.layers.0.self_attn.q_proj`), and how its A and B come from the megatron ones."""

    module: str
    layer: str
    column: bool


def hf_parts(layer: str, layout: MegatronLayout) -> list[HfAdapterPart]:
    """The Hugging Face modules the adapter of megatron layer `layer` stands for."""
    column = layer.rsplit(".", 1)[-1] in _COLUMN_PARALLEL
    return [
        HfAdapterPart(n.removesuffix(".weight"), layer, column)
        for n in hf_names_for(f"{layer}.weight", layout)
    ]


def hf_adapter(layer: str, a: list[torch.Tensor], b: list[torch.Tensor],
               layout: MegatronLayout) -> Iterator[tuple[str, torch.Tensor]]:
    """(`<hf module>.lora_A.weight` / `.lora_B.weight`, tensor) of one layer's adapter from every TP
    rank's A and B (rank order; a whole one once): the split of the fused B rows (column-parallel
    layers, whose HF modules share A), or the whole A (row-parallel)."""
    from inflight.megatron.convert import megatron_shards_to_hf

    parts = hf_parts(layer, layout)
    split = megatron_shards_to_hf(f"{layer}.weight", b if parts[0].column else a, layout)
    for part, (_, tensor) in zip(parts, split, strict=True):
        yield f"{part.module}.lora_A.weight", a[0] if part.column else tensor
        yield f"{part.module}.lora_B.weight", tensor if part.column else b[0]


def megatron_adapter(layer: str, hf: dict[str, torch.Tensor], layout: MegatronLayout,
                     tp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's (A, B) of one layer from Hugging Face adapter tensors (`hf_adapter`'s names);
    ValueError when the HF modules of a fused layer do not share A."""
    parts = hf_parts(layer, layout)
    weights = {f"{p.module}.weight": p.module for p in parts}
    if parts[0].column:
        shared = hf[f"{parts[0].module}.lora_A.weight"]
        if any(not torch.equal(hf[f"{p.module}.lora_A.weight"], shared) for p in parts[1:]):
            raise ValueError(
                f"the adapter's {', '.join(p.module for p in parts)} have different lora_A: megatron's "
                f"{layer} holds one A for all of them (SkyRL's lora_type=lora)"
            )
        b = hf_to_megatron_shard(
            f"{layer}.weight", lambda n: hf[f"{weights[n]}.lora_B.weight"], layout, tp_rank
        )
        return shared.clone(), b
    a = hf_to_megatron_shard(f"{layer}.weight", lambda n: hf[f"{weights[n]}.lora_A.weight"], layout, tp_rank)
    return a, hf[f"{parts[0].module}.lora_B.weight"].clone()
