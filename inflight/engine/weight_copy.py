"""A received weight copied into engine memory, refusing values the engine could not hold.

The check of a weight update for NaN and inf is on the sync's pause, so it rides on the copy: for a
same-dtype copy on CPU the native kernel (`kernels/weight_copy.c`) counts non-finite values while it
copies (one pass, memcpy speed); otherwise the tensor is copied (cast) and the destination checked
with a sum, which is one read of it (a value beyond the destination dtype's range became inf in the
cast, so that is refused too). The destination is never a live parameter while rollback is on: the
engine copies into the spare buffer and swaps it in only when the copy is accepted.

A tensor larger than a transport's buffer arrives as `WeightPiece`s (flat element ranges), each
copied straight into its place in the destination: a split tensor is never put back together in a
temporary of its own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from inflight.engine import kernels
from inflight.engine.errors import WeightUpdateError

_EXPONENT_BITS = {torch.float32: 0x7F800000, torch.bfloat16: 0x7F80, torch.float16: 0x7C00}


@dataclass(frozen=True)
class WeightPiece:
    """Elements `[start, start + data.numel())` (row-major) of a weight of `shape`; `data` is
    1-D (a view of a transport's buffer: the engine copies it before the buffer is reused)."""

    data: torch.Tensor
    start: int
    shape: tuple[int, ...]

    @property
    def end(self) -> int:
        return self.start + self.data.numel()

    @property
    def total_numel(self) -> int:
        return math.prod(self.shape)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _native_copy(dst: torch.Tensor, src: torch.Tensor) -> int | None:
    """Non-finite values copied by the native kernel, or None where it does not apply."""
    if not (src.dtype == dst.dtype in _EXPONENT_BITS and src.device.type == dst.device.type == "cpu"):
        return None
    if not (src.is_contiguous() and dst.is_contiguous()) or src.numel() == 0:
        return None
    lib = kernels.load()
    if lib is None:
        return None
    return int(lib.copy_count_nonfinite(dst.data_ptr(), src.data_ptr(), src.numel(), src.element_size(),
                                        _EXPONENT_BITS[src.dtype], torch.get_num_threads()))


def _all_finite(tensor: torch.Tensor) -> bool:
    # a sum is one read (isfinite(t).all() writes a mask: 5x a memcpy); NaN or inf anywhere makes
    # it non-finite, and only then is each value looked at (a sum that merely overflowed is fine)
    return bool(torch.isfinite(tensor.sum())) or bool(torch.isfinite(tensor).all())


def copy_weight(dst: torch.Tensor, src: torch.Tensor, hf_name: str) -> None:
    """Copy `src` into `dst` (cast to its dtype); raises WeightUpdateError naming `hf_name` when
    `dst` then holds NaN or inf (sent as such, or beyond the dtype's range). `dst` holds the bad
    values afterwards: the caller decides what becomes of it."""
    bad = _native_copy(dst, src)
    if bad is None:
        with torch.no_grad():
            dst.copy_(src)
        bad = 0 if _all_finite(dst) else 1
    if bad:
        if src.dtype != dst.dtype and _all_finite(src):
            biggest = float(src.abs().max())
            raise WeightUpdateError(
                f"parameter {hf_name!r} holds {biggest:.3g}, beyond {_dtype_name(dst.dtype)}'s largest value "
                f"{torch.finfo(dst.dtype).max:.3g}"
            )
        raise WeightUpdateError(f"parameter {hf_name!r} holds NaN or inf values; the update is refused")
