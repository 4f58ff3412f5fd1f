"""Fused elementwise kernels against transformers' own modules and against the PyTorch reference."""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile
from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm, apply_rotary_pos_emb

from inflight.engine import EngineConfig, InvalidRequestError, LLMEngine, SamplingParams, kernels
from inflight.engine.models.layer_ops import NativeOps, TorchOps

pytestmark = pytest.mark.skipif(kernels.load() is None, reason="native kernels unavailable (no C compiler)")
DTYPES = [torch.float32, torch.bfloat16]


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, exact_bf16: bool = True) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    if dtype == torch.bfloat16 and exact_bf16:  # the kernels round where transformers rounds: bit-equal
        assert torch.equal(got, want), (got.float() - want.float()).abs().max()
    elif dtype == torch.bfloat16:  # a bf16 step or two apart (bf16 keeps 8 significant bits)
        torch.testing.assert_close(got, want, atol=1e-3, rtol=2**-6)
    else:
        torch.testing.assert_close(got, want, atol=3e-6, rtol=3e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "dim"), [(1, 64), (7, 96), (300, 512)])  # the last runs threaded
def test_rms_norm_matches_transformers(dtype, rows, dim, lib):
    torch.manual_seed(rows)
    hf = Qwen2RMSNorm(dim, eps=1e-6).to(dtype)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(dim))
    x = torch.randn(rows, dim, dtype=dtype) * 3
    with torch.inference_mode():
        _close(NativeOps(lib).rms_norm(x, hf.weight, 1e-6), hf(x), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_updates_the_residual_like_transformers(dtype, lib):
    torch.manual_seed(1)
    hf = Qwen2RMSNorm(160, eps=1e-5).to(dtype)
    residual, delta = torch.randn(33, 160, dtype=dtype), torch.randn(33, 160, dtype=dtype)
    want_sum = residual + delta
    with torch.inference_mode():
        want = hf(want_sum)
        got = NativeOps(lib).add_rms_norm(residual, delta, hf.weight, 1e-5)
    assert torch.equal(residual, want_sum)
    _close(got, want, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", [1, 4])
def test_rotary_matches_transformers(dtype, heads, lib):
    torch.manual_seed(heads)
    tokens, dim = 37, 64
    table = torch.randn(128, 2, dim)
    positions = torch.randint(0, 128, (tokens,))
    q, k = torch.randn(tokens, heads, dim, dtype=dtype), torch.randn(tokens, 2, dim, dtype=dtype)
    cos = table[positions, 0].to(dtype)[None]  # transformers: [batch, seq, dim], heads on dim 1
    sin = table[positions, 1].to(dtype)[None]
    want_q, want_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    ops = NativeOps(lib)
    got_q, got_k = ops.rotary(q.clone(), table, positions), ops.rotary(k.clone(), table, positions)
    _close(got_q, want_q[0].transpose(0, 1).contiguous(), dtype)
    _close(got_k, want_k[0].transpose(0, 1).contiguous(), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_and_silu_mul_on_column_slices_of_a_fused_output(dtype, lib):
    """q/k of a fused q|k|v matrix and gate/up of a fused gate|up matrix are strided views."""
    torch.manual_seed(2)
    tokens, dim, table = 11, 32, torch.randn(64, 2, 32)
    positions = torch.randint(0, 64, (tokens,))
    qkv = torch.randn(tokens, 4 * dim + 2 * dim + 2 * dim, dtype=dtype)
    q = qkv[:, : 4 * dim].view(tokens, 4, dim)
    want = TorchOps.rotary(q.clone(), table, positions)
    got = NativeOps(lib).rotary(q, table, positions)
    assert got.data_ptr() == qkv.data_ptr()  # rotated in place inside the fused matrix
    _close(got, want, dtype)
    gate_up = torch.randn(5, 2 * 96, dtype=dtype)
    gate, up = gate_up.split(96, dim=-1)
    _close(NativeOps(lib).silu_mul(gate, up), torch.nn.functional.silu(gate) * up, dtype, exact_bf16=False)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [3, 64])
def test_silu_mul_matches_pytorch(dtype, rows, lib):
    gate, up = torch.randn(rows, 1536, dtype=dtype) * 4, torch.randn(rows, 1536, dtype=dtype)
    # expf and PyTorch's vectorised exp differ in the last float32 bit, which can flip a bf16 rounding
    _close(NativeOps(lib).silu_mul(gate, up), torch.nn.functional.silu(gate) * up, dtype, exact_bf16=False)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_over_the_whole_float_range_and_ragged_rows(dtype, lib):
    """Saturating inputs (exp overflows or underflows) and rows that are not a multiple of 16 lanes."""
    gate = torch.cat([torch.linspace(-120, 120, 301), torch.tensor([-1e30, -88.8, 88.8, 1e30, 0.0])])
    gate = gate.reshape(6, 51).to(dtype)
    up = torch.randn(6, 51).to(dtype)
    got = NativeOps(lib).silu_mul(gate, up)
    assert torch.isfinite(got).all()
    _close(got, torch.nn.functional.silu(gate) * up, dtype, exact_bf16=False)


def test_unsupported_inputs_fall_back_to_pytorch(lib):
    ops, ref = NativeOps(lib), TorchOps()
    x = torch.randn(8, 32).t()  # not contiguous
    w = torch.randn(8)
    assert torch.equal(ops.rms_norm(x, w, 1e-6), ref.rms_norm(x, w, 1e-6))
    half = torch.randn(5, 16, dtype=torch.float16)
    assert torch.equal(ops.silu_mul(half, half), ref.silu_mul(half, half))


def _ops_in_forward(engine: LLMEngine) -> set[str]:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        engine.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    return {event.key for event in prof.key_averages()}


def test_engine_runs_fused_kernels_by_default_on_cpu(tiny_model_factory):
    model_dir = str(tiny_model_factory("qwen2"))
    fused = _ops_in_forward(LLMEngine(EngineConfig(model=model_dir, block_size=4)))
    plain = _ops_in_forward(
        LLMEngine(EngineConfig(model=model_dir, block_size=4, elementwise_backend="torch"))
    )
    assert {"aten::silu", "aten::rsqrt", "aten::cat"} <= plain
    assert not {"aten::silu", "aten::rsqrt", "aten::cat"} & fused


def test_config_names_bad_elementwise_backend(tiny_model_factory):
    with pytest.raises(InvalidRequestError, match="elementwise_backend='fused'"):
        LLMEngine(EngineConfig(model=str(tiny_model_factory("qwen2")), elementwise_backend="fused"))
    with pytest.raises(kernels.NativeKernelError, match="elementwise_backend='native'.*float16"):
        LLMEngine(
            EngineConfig(
                model=str(tiny_model_factory("qwen2")), dtype="float16", elementwise_backend="native"
            )
        )
