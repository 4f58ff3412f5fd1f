"""Linear layers that multiply by a oneDNN-prepacked copy of their weight on CPU.

PyTorch's CPU `F.linear` hands fp32 to a BLAS that re-lays out the weight on every call; for the
engine's shapes (a few to a few hundred rows against a weight that has left the cache since the
previous layer) that runs at a third to two thirds of the speed of a oneDNN matmul on a weight
reordered once into oneDNN's blocked layout (`inflight bench engine` and the measurements in
docs/design.md). So each `PackedLinear` keeps its HF-named `weight` parameter, the one that
updates, checkpoints and `named_parameters()` see, plus a packed copy derived from it.

A packed copy is a cache of the weight and must never outlive it. It is rebuilt on first use after
`invalidate_packed()`, which every code path that changes weights calls (loading, updates,
rollback, sleep, wake), and also whenever the weight's storage or in-place version counter differs
from the ones it was packed from, so a direct `param.copy_()` cannot leave it stale either.

What oneDNN packs depends on the CPU, not only on the build: without AVX-512 (or AVX-NE-CONVERT)
it refuses bfloat16 weights at run time. `resolve_linear_backend` asks it once (`cpu.onednn_packing`)
and, for bfloat16 there, packs a float32 copy and computes in float32 (`onednn_fp32`): the same
products and float32 sums oneDNN's bfloat16 matmul would make, rounded to bfloat16 at the end.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from inflight.engine import cpu

LINEAR_BACKENDS = ("auto", "onednn", "onednn_fp32", "torch")
# A oneDNN call costs ~15 us before any arithmetic; float32 F.linear (MKL) ~5 us. For float32
# weights this small and this few rows the overhead dominates and F.linear is faster (measured on 2
# cores: 128x128 at 16 rows 11 vs 19 us); above either bound the packed matmul wins. bfloat16
# F.linear goes through oneDNN anyway, without the packed weight: packed always wins there.
_SMALL_WEIGHT_NUMEL = 128 * 512
_SMALL_ROWS = 64
_LINEAR_POINTWISE = None  # torch.ops.mkldnn._linear_pointwise.default, resolved on first use


def _small(rows: int, weight_numel: int, dtype: torch.dtype) -> bool:
    """Whether F.linear beats the packed matmul for this call (see _SMALL_ROWS)."""
    return rows < _SMALL_ROWS and weight_numel <= _SMALL_WEIGHT_NUMEL and dtype == torch.float32


def _linear_pointwise(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    global _LINEAR_POINTWISE
    if _LINEAR_POINTWISE is None:  # the overload itself: skips the packet's per-call dispatch in Python
        _LINEAR_POINTWISE = torch.ops.mkldnn._linear_pointwise.default
    return _LINEAR_POINTWISE(x, packed, bias, "none", [], "")


def onednn_available() -> bool:
    """Whether this torch build has the oneDNN packed-linear ops (whether they run: `onednn_supports`)."""
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


def onednn_supports(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether oneDNN packs and multiplies weights of this dtype on this device (probed once)."""
    return device.type == "cpu" and cpu.onednn_packing(dtype)[0]


class PackedWeights:
    """A packed copy of some linear layers' weights side by side (and their biases), in the dtype the
    matmul computes in: a cache of the parameters, re-made whenever any of them has other storage
    or another in-place version than the ones it was made from, dropped by `invalidate`."""

    def __init__(self, parts: list[nn.Linear]) -> None:
        self.parts = parts
        # the modules' own dicts: a parameter re-assigned to a module is seen here too
        self._param_dicts = [p._parameters for p in parts]
        self.invalidate()

    def invalidate(self) -> None:
        self.packed: torch.Tensor | None = None
        self.bias: torch.Tensor | None = None
        self._made_from: list[int] | None = None

    def _source_key(self) -> list[int]:
        key = []
        # a plain loop over the parameter dicts (not Module.__getattr__): this runs on every call
        for params in self._param_dicts:
            weight, bias = params["weight"], params["bias"]
            key += (weight.data_ptr(), weight._version)
            if bias is not None:
                key += (bias.data_ptr(), bias._version)
        return key

    def get(self, compute_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(packed weight, bias) in `compute_dtype`, packing the current weights when needed."""
        key = self._source_key()
        if self.packed is None or self._made_from != key or self.packed.dtype != compute_dtype:
            with torch.no_grad():
                parts = self.parts
                weight = (
                    torch.cat([p.weight.detach() for p in parts])
                    if len(parts) > 1
                    else parts[0].weight.detach()
                )
                self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.to(compute_dtype))
                biases = [p.bias for p in parts]
                self.bias = None if all(b is None for b in biases) else torch.cat(
                    [b.detach() if b is not None else weight.new_zeros(p.out_features)
                     for b, p in zip(biases, parts, strict=True)]
                ).to(compute_dtype)  # fmt: skip
            self._made_from = key
        return self.packed, self.bias


def _packed_matmul(x: torch.Tensor, weights: PackedWeights, compute_dtype: torch.dtype) -> torch.Tensor:
    """x [rows, in] times the packed weights, in `compute_dtype`, returned in x's dtype."""
    packed, bias = weights.get(compute_dtype)
    if x.dtype is compute_dtype:  # skips two no-op .to() calls per matmul on the decode path
        return _linear_pointwise(x.contiguous(), packed, bias)
    return _linear_pointwise(x.to(compute_dtype).contiguous(), packed, bias).to(x.dtype)


class PackedLinear(nn.Linear):
    """`nn.Linear` (same parameters, same names) that, once `use_packed(dtype)`, multiplies by a
    oneDNN-packed copy of its weight computing in `dtype` (the weight's own, or float32 for
    bfloat16 weights where oneDNN cannot pack bfloat16)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.compute_dtype: torch.dtype | None = None
        self.packed_weights = PackedWeights([self])

    def use_packed(self, compute_dtype: torch.dtype | None) -> None:
        """Multiply on a packed copy computing in `compute_dtype`; None: plain F.linear."""
        self.compute_dtype = compute_dtype
        self.invalidate()

    def invalidate(self) -> None:
        """Drop the packed copy (its memory too); the next forward packs the current weight."""
        self.packed_weights.invalidate()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        compute_dtype = self.compute_dtype
        if compute_dtype is None:
            return F.linear(x, self.weight, self.bias)
        if x.dim() == 2:  # the engine's case: no reshape and view around the matmul
            weight = self._parameters["weight"]
            if _small(x.shape[0], weight.numel(), weight.dtype):
                return F.linear(x, weight, self._parameters["bias"])
            return _packed_matmul(x, self.packed_weights, compute_dtype)
        rows = x.reshape(-1, self.in_features)
        if _small(rows.shape[0], self.weight.numel(), self.weight.dtype):
            return F.linear(x, self.weight, self.bias)
        out = _packed_matmul(rows, self.packed_weights, compute_dtype)
        return out.view(*x.shape[:-1], self.out_features)


class FusedLinear:
    """Linears that read the same input (q/k/v, gate/up) multiplied as one packed matmul.

    One call instead of several: at the few rows of a decode step the fixed cost of each call and
    the narrow outputs dominate (2 threads, 13 layers, q/k/v + gate/up: 1.43x at 1 row, 1.13x at
    32, 1.06x at 256, bf16). The parts stay the modules that own the HF-named parameters; this
    holds a packed copy of their concatenated weights (and biases), computing in the parts'
    compute dtype and dropped by `invalidate_packed`. Outputs are column slices of one matrix (row
    stride = the sum of the parts' widths).
    """

    def __init__(self, parts: list[PackedLinear]) -> None:
        self.parts = parts
        self.widths = [p.out_features for p in parts]
        self.numel = sum(p.weight.numel() for p in parts)
        self.packed_weights = PackedWeights(parts)

    def invalidate(self) -> None:
        self.packed_weights.invalidate()

    def matrix(self, x: torch.Tensor) -> torch.Tensor | None:
        """The parts' outputs for `x` [rows, in_features] side by side in one [rows, sum of widths]
        matrix, or None where this call would not run fused (then call the parts)."""
        first = self.parts[0]
        compute_dtype = first.compute_dtype
        if compute_dtype is None or _small(x.shape[0], self.numel, first._parameters["weight"].dtype):
            return None
        return _packed_matmul(x, self.packed_weights, compute_dtype)

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Each part's output for `x` [rows, in_features]."""
        out = self.matrix(x)
        if out is None:
            return [p(x) for p in self.parts]
        return list(out.split(self.widths, dim=-1))


def packed_linears(module: nn.Module) -> list[PackedLinear]:
    return [m for m in module.modules() if isinstance(m, PackedLinear)]


def invalidate_packed(module: nn.Module) -> None:
    """Drop every packed copy under `module` (fused ones included): call after any change to its weights."""
    for m in module.modules():
        if isinstance(m, PackedLinear):
            m.invalidate()
        for fused in getattr(m, "fused_linears", ()):
            fused.invalidate()


def resolve_linear_backend(backend: str, dtype: torch.dtype, device: torch.device) -> str:
    """`auto` -> `onednn` where oneDNN packs this dtype here, else `onednn_fp32` for bfloat16 weights
    where it packs float32 (CPUs without AVX-512: bf16 computed in float32 runs 4-5x faster there
    than torch's bf16 matmul), else `torch`. An explicit choice that cannot run raises ValueError
    naming why and what to use instead."""
    if backend not in LINEAR_BACKENDS:
        raise ValueError(f"linear_backend={backend!r} must be one of {list(LINEAR_BACKENDS)}")
    if backend == "auto":
        if onednn_supports(dtype, device):
            return "onednn"
        if dtype == torch.bfloat16 and onednn_supports(torch.float32, device):
            return "onednn_fp32"
        return "torch"
    if backend == "onednn" and not onednn_supports(dtype, device):
        raise ValueError(f"linear_backend='onednn' cannot run {dtype} weights on {device}: "
                         f"{_why_not(dtype, device)}; {_instead(dtype, device)}")  # fmt: skip
    if backend == "onednn_fp32" and not (dtype == torch.bfloat16 and onednn_supports(torch.float32, device)):
        why = "it is for bfloat16 weights" if dtype != torch.bfloat16 else _why_not(torch.float32, device)
        raise ValueError(f"linear_backend='onednn_fp32' cannot run {dtype} weights on {device}: {why}; "
                         f"{_instead(dtype, device)}")  # fmt: skip
    return backend


def packed_compute_dtype(backend: str, dtype: torch.dtype) -> torch.dtype | None:
    """The dtype packed linears compute in for a resolved `backend` (None: no packing)."""
    return {"onednn": dtype, "onednn_fp32": torch.float32}.get(backend)


def _why_not(dtype: torch.dtype, device: torch.device) -> str:
    if device.type != "cpu":
        return "oneDNN packed linears run on CPU only"
    return (
        f"{cpu.onednn_packing(dtype)[1]} "
        f"(CPU: {cpu.cpu_model()}, torch capability {cpu.torch_cpu_capability()})"
    )


def _instead(dtype: torch.dtype, device: torch.device) -> str:
    return f"use linear_backend='auto' (here: {resolve_linear_backend('auto', dtype, device)!r}) or 'torch'"
