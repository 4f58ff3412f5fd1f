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
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

LINEAR_BACKENDS = ("auto", "onednn", "torch")
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


_PACKABLE_DTYPES = (torch.float32, torch.bfloat16)


def onednn_available() -> bool:
    """Whether this torch build has the oneDNN packed-linear ops."""
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


def onednn_supports(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether packed linears can run for weights of this dtype on this device."""
    return device.type == "cpu" and dtype in _PACKABLE_DTYPES and onednn_available()


def _tensor_key(t: torch.Tensor | None) -> tuple[int, int]:
    """What identifies a tensor's current contents: its storage pointer and in-place version."""
    return (0, 0) if t is None else (t.data_ptr(), t._version)


class PackedLinear(nn.Linear):
    """`nn.Linear` (same parameters, same names) that, once `use_packed(True)`, runs on a packed copy."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.packed_enabled = False
        self._packed: torch.Tensor | None = None
        self._packed_from: tuple[int, int] | None = None  # (data_ptr, _version) of the packed weight

    def use_packed(self, enabled: bool) -> None:
        self.packed_enabled = enabled
        self.invalidate()

    def invalidate(self) -> None:
        """Drop the packed copy (its memory too); the next forward packs the current weight."""
        self._packed = None
        self._packed_from = None

    def packed_weight(self) -> torch.Tensor:
        """The packed copy of the current weight, packing it first when there is none or it is stale."""
        key = _tensor_key(self.weight)
        if self._packed is None or self._packed_from != key:
            with torch.no_grad():
                self._packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach())
            self._packed_from = key
        return self._packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.packed_enabled:
            return F.linear(x, self.weight, self.bias)
        rows = x.reshape(-1, self.in_features)
        if _small(rows.shape[0], self.weight.numel(), self.weight.dtype):
            return F.linear(x, self.weight, self.bias)
        out = _linear_pointwise(rows.contiguous(), self.packed_weight(), self.bias)
        return out.view(*x.shape[:-1], self.out_features)


class FusedLinear:
    """Linears that read the same input (q/k/v, gate/up) multiplied as one packed matmul.

    One call instead of several: at the few rows of a decode step the fixed cost of each call and
    the narrow outputs dominate (2 threads, 13 layers, q/k/v + gate/up: 1.43x at 1 row, 1.13x at
    32, 1.06x at 256, bf16). The parts stay the modules that own the HF-named parameters; this
    holds a packed copy of their concatenated weights (and biases), keyed like PackedLinear's and
    dropped by `invalidate_packed`. Outputs are column slices of one matrix (row stride = the sum
    of the parts' widths).
    """

    def __init__(self, parts: list[PackedLinear]) -> None:
        self.parts = parts
        self.widths = [p.out_features for p in parts]
        self.numel = sum(p.weight.numel() for p in parts)
        self.invalidate()

    def invalidate(self) -> None:
        self._packed: torch.Tensor | None = None
        self._bias: torch.Tensor | None = None
        self._packed_from: list[int] | None = None

    def _source_key(self) -> list[int]:
        key = []
        for part in self.parts:  # a plain loop: this runs on every call
            weight, bias = part.weight, part.bias
            key += (weight.data_ptr(), weight._version)
            if bias is not None:
                key += (bias.data_ptr(), bias._version)
        return key

    def _pack(self) -> torch.Tensor:
        key = self._source_key()
        if self._packed is None or self._packed_from != key:
            with torch.no_grad():
                weight = torch.cat([p.weight.detach() for p in self.parts])
                self._packed = torch.ops.mkldnn._reorder_linear_weight(weight)
                biases = [p.bias for p in self.parts]
                self._bias = None if all(b is None for b in biases) else torch.cat(
                    [b.detach() if b is not None else weight.new_zeros(p.out_features)
                     for b, p in zip(biases, self.parts, strict=True)]
                )  # fmt: skip
            self._packed_from = key
        return self._packed

    def matrix(self, x: torch.Tensor) -> torch.Tensor | None:
        """The parts' outputs for `x` [rows, in_features] side by side in one [rows, sum of widths]
        matrix, or None where this call would not run fused (then call the parts)."""
        first = self.parts[0]
        if not first.packed_enabled or _small(x.shape[0], self.numel, first.weight.dtype):
            return None
        return _linear_pointwise(x.contiguous(), self._pack(), self._bias)

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
    """`auto` -> `onednn` where supported, else `torch`; `onednn` raises where it cannot run."""
    if backend not in LINEAR_BACKENDS:
        raise ValueError(f"linear_backend={backend!r} must be one of {list(LINEAR_BACKENDS)}")
    supported = onednn_supports(dtype, device)
    if backend == "onednn" and not supported:
        raise ValueError(
            f"linear_backend='onednn' needs CPU float32/bfloat16 weights and a torch build with oneDNN, not "
            f"{dtype} on {device} (oneDNN available: {onednn_available()}); use linear_backend='torch' or 'auto'"
        )
    if backend == "auto":
        return "onednn" if supported else "torch"
    return backend
