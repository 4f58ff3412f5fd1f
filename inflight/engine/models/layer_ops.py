"""The elementwise steps of a decoder layer, in two interchangeable implementations.

`TorchOps` is the reference: PyTorch ops written as `transformers` writes them. `NativeOps` calls
the fused C kernels of `inflight.engine.kernels` (one pass, no temporaries) and falls back to
`TorchOps` for what they do not cover (other dtypes or devices, non-contiguous input). Tests hold
the two equal.
"""

from __future__ import annotations

import ctypes

import torch

from inflight.engine.attention import rows_of_heads

_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}


class TorchOps:
    """The reference implementation (PyTorch eager, transformers' order of operations)."""

    native = False  # whether these are the C kernels (the decode fast path needs them)

    @staticmethod
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        return weight * x32.to(dtype)

    def add_rms_norm(
        self, residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """residual += delta (in place), then RMSNorm of the sum."""
        residual.add_(delta)
        return self.rms_norm(residual, weight, eps)

    @staticmethod
    def rotary(x: torch.Tensor, cos_sin_table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [T, H, D] rotated by the table [max_pos, 2, D] at each token's position."""
        cos_sin = cos_sin_table[positions].to(x.dtype)
        cos, sin = cos_sin[:, 0, None, :], cos_sin[:, 1, None, :]
        half = x.shape[-1] // 2
        return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin

    @staticmethod
    def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.silu(gate) * up

    def silu_mul_halves(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up for a fused [rows, 2 * dim] gate|up matrix (gate on the left)."""
        half = gate_up.shape[-1] // 2
        return self.silu_mul(gate_up[..., :half], gate_up[..., half:])

    def rotary_columns(
        self, x: torch.Tensor, heads: int, cos_sin_table: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        """Rotate, in place, the first `heads` heads of each row of a 2-D matrix [T, >= heads * D]
        (the q|k columns of a fused q|k|v output); returns x."""
        dim = cos_sin_table.shape[-1]
        cols = x[:, : heads * dim].view(x.shape[0], heads, dim)
        rotated = self.rotary(cols, cos_sin_table, positions)
        if rotated is not cols:
            cols.copy_(rotated)
        return x


class NativeOps(TorchOps):
    """The fused C kernels; TorchOps where they do not apply."""

    native = True

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib

    @staticmethod
    def _native(*tensors: torch.Tensor) -> bool:
        first = tensors[0]
        dtype = first.dtype
        if not first.is_cpu or dtype not in _DTYPE_CODES:  # is_cpu: no torch.device object per call
            return False
        for t in tensors:  # a plain loop: this runs a few times per layer and step
            if t.dtype != dtype or not t.is_contiguous():
                return False
        return True

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if not self._native(x, weight):
            return TorchOps.rms_norm(x, weight, eps)
        out = torch.empty_like(x)
        self._norm(x, None, weight, out, eps)
        return out

    def add_rms_norm(
        self, residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        if not self._native(residual, delta, weight):
            return super().add_rms_norm(residual, delta, weight, eps)
        out = torch.empty_like(residual)
        self._norm(residual, delta, weight, out, eps)
        return out

    def _norm(self, x, delta, weight, out, eps: float) -> None:
        dim = x.shape[-1]
        status = self.lib.fused_rms_norm(
            x.data_ptr(), None if delta is None else delta.data_ptr(), weight.data_ptr(), out.data_ptr(),
            x.numel() // dim, dim, eps, _DTYPE_CODES[x.dtype], torch.get_num_threads(),
        )  # fmt: skip
        if status != 0:
            raise RuntimeError(f"fused_rms_norm failed with status {status}")

    def rotary(self, x: torch.Tensor, cos_sin_table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """In place when native (x is returned)."""
        native = (
            x.is_cpu and x.dtype in _DTYPE_CODES and rows_of_heads(x)
            and cos_sin_table.dtype == torch.float32 and cos_sin_table.is_contiguous()
            and positions.dtype == torch.int64 and positions.is_contiguous()
        )  # fmt: skip
        if not native:
            return TorchOps.rotary(x, cos_sin_table, positions)
        tokens, heads, dim = x.shape
        status = self.lib.fused_rotary(
            x.data_ptr(), tokens, x.stride(0), heads, dim, cos_sin_table.data_ptr(), positions.data_ptr(),
            _DTYPE_CODES[x.dtype], torch.get_num_threads(),
        )  # fmt: skip
        if status != 0:
            raise RuntimeError(f"fused_rotary failed with status {status}")
        return x

    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """gate and up may be the two column halves of one fused gate|up matrix."""
        native = (
            gate.is_cpu and gate.dtype in _DTYPE_CODES and up.dtype == gate.dtype
            and gate.dim() == 2 and gate.shape == up.shape and gate.stride(1) == 1 and up.stride(1) == 1
            and gate.stride(0) == up.stride(0)
        )  # fmt: skip
        if not native:
            return TorchOps.silu_mul(gate, up)
        rows, dim = gate.shape
        out = torch.empty(rows, dim, dtype=gate.dtype)
        status = self.lib.fused_silu_mul(
            gate.data_ptr(), up.data_ptr(), gate.stride(0), out.data_ptr(), rows, dim,
            _DTYPE_CODES[gate.dtype], torch.get_num_threads(),
        )  # fmt: skip
        if status != 0:
            raise RuntimeError(f"fused_silu_mul failed with status {status}")
        return out

    def silu_mul_halves(self, gate_up: torch.Tensor) -> torch.Tensor:
        """One kernel call on the fused matrix's two halves, no views made (the decode path)."""
        dtype = gate_up.dtype
        if not (gate_up.is_cpu and dtype in _DTYPE_CODES and gate_up.dim() == 2 and gate_up.is_contiguous()):
            return super().silu_mul_halves(gate_up)
        rows, width = gate_up.shape
        dim = width // 2
        out = torch.empty(rows, dim, dtype=dtype)
        gate = gate_up.data_ptr()
        status = self.lib.fused_silu_mul(
            gate, gate + dim * gate_up.element_size(), width, out.data_ptr(), rows, dim, _DTYPE_CODES[dtype],
            torch.get_num_threads(),
        )  # fmt: skip
        if status != 0:
            raise RuntimeError(f"fused_silu_mul failed with status {status}")
        return out

    def rotary_columns(
        self, x: torch.Tensor, heads: int, cos_sin_table: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        """One kernel call on x's rows, no views made (the decode path)."""
        native = (
            x.is_cpu and x.dtype in _DTYPE_CODES and x.dim() == 2 and x.is_contiguous()
            and cos_sin_table.dtype == torch.float32 and cos_sin_table.is_contiguous()
            and positions.dtype == torch.int64 and positions.is_contiguous()
        )  # fmt: skip
        if not native:
            return super().rotary_columns(x, heads, cos_sin_table, positions)
        status = self.lib.fused_rotary(
            x.data_ptr(), x.shape[0], x.shape[1], heads, cos_sin_table.shape[-1], cos_sin_table.data_ptr(),
            positions.data_ptr(), _DTYPE_CODES[x.dtype], torch.get_num_threads(),
        )  # fmt: skip
        if status != 0:
            raise RuntimeError(f"fused_rotary failed with status {status}")
        return x
