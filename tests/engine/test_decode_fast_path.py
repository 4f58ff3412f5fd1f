"""The decode step's pointer path: rotary, attention and silu*up straight on the fused matmul outputs
(no views), against transformers' rotary, SDPA, torch's silu and transformers generate()."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen2.modeling_qwen2 import apply_rotary_pos_emb

from inflight.engine import EngineConfig, LLMEngine, SamplingParams, kernels
from inflight.engine.attention import Workspace, build_metadata, paged_attention_qkv
from inflight.engine.models import common
from inflight.engine.models import linear as linear_module
from inflight.engine.models.layer_ops import NativeOps, TorchOps
from inflight.testing.oracle import hf_greedy

pytestmark = pytest.mark.skipif(kernels.load() is None, reason="native kernels unavailable (no C compiler)")
DTYPES = [torch.float32, torch.bfloat16]


def _tol(dtype: torch.dtype) -> dict[str, float]:
    return {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ops_kind", ["native", "torch"])
def test_rotary_columns_rotate_q_and_k_in_place_like_transformers(dtype, ops_kind, lib):
    torch.manual_seed(0)
    tokens, heads, kv_heads, dim = 5, 4, 2, 32
    table = torch.randn(64, 2, dim)
    positions = torch.randint(0, 64, (tokens,))
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, dtype=dtype)
    q = qkv[:, : heads * dim].view(tokens, heads, dim).transpose(0, 1)[None].clone()
    k = (
        qkv[:, heads * dim : (heads + kv_heads) * dim]
        .view(tokens, kv_heads, dim)
        .transpose(0, 1)[None]
        .clone()
    )
    v = qkv[:, (heads + kv_heads) * dim :].clone()
    cos, sin = table[positions, 0][None].to(dtype), table[positions, 1][None].to(dtype)
    want_q, want_k = apply_rotary_pos_emb(q, k, cos, sin)
    ops = NativeOps(lib) if ops_kind == "native" else TorchOps()
    assert ops.rotary_columns(qkv, heads + kv_heads, table, positions) is qkv
    got_q = qkv[:, : heads * dim].view(tokens, heads, dim)
    got_k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(tokens, kv_heads, dim)
    torch.testing.assert_close(got_q, want_q[0].transpose(0, 1), **_tol(dtype))
    torch.testing.assert_close(got_k, want_k[0].transpose(0, 1), **_tol(dtype))
    assert torch.equal(qkv[:, (heads + kv_heads) * dim :], v)  # the v columns are left alone


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 9])
def test_silu_mul_halves_equal_torch_on_the_fused_matrix(dtype, rows, lib):
    torch.manual_seed(rows)
    gate_up = torch.randn(rows, 2 * 96, dtype=dtype) * 3
    want = F.silu(gate_up[:, :96]) * gate_up[:, 96:]
    for ops in (NativeOps(lib), TorchOps()):
        torch.testing.assert_close(ops.silu_mul_halves(gate_up), want, **_tol(dtype))
    strided = torch.randn(2 * 96, rows, dtype=dtype).t()  # not contiguous: the view path
    torch.testing.assert_close(NativeOps(lib).silu_mul_halves(strided),
                               F.silu(strided[:, :96]) * strided[:, 96:], **_tol(dtype))  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("native", [True, False])
def test_attention_on_a_fused_qkv_matrix_equals_sdpa(dtype, native, lib):
    """A decode step of 3 sequences: new keys/values land at their slots, outputs equal SDPA over
    the whole context, through the pointer path (native) and through views + gather + SDPA."""
    torch.manual_seed(1)
    heads, kv_heads, dim, block = 4, 2, 16, 4
    lens = [3, 9, 6]  # context after this step, the new token included
    tables = [[1, 2], [3, 4, 5], [6, 7]]
    k_cache = torch.randn(8, block, kv_heads, dim).to(dtype)
    v_cache = torch.randn(8, block, kv_heads, dim).to(dtype)
    qkv = torch.randn(len(lens), (heads + 2 * kv_heads) * dim, dtype=dtype)
    slots = [t[(n - 1) // block] * block + (n - 1) % block for t, n in zip(tables, lens, strict=True)]
    meta = build_metadata(slots, tables, lens, [], [], block, torch.device("cpu"), Workspace(),
                          lib if native else None)  # fmt: skip
    assert meta.native_only == native
    out = paged_attention_qkv(qkv, heads, kv_heads, dim, k_cache, v_cache, meta, dim**-0.5)
    assert out.shape == (len(lens), heads * dim)
    new_k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(-1, kv_heads, dim)
    new_v = qkv[:, (heads + kv_heads) * dim :].view(-1, kv_heads, dim)
    assert torch.equal(k_cache.view(-1, kv_heads, dim)[slots], new_k)
    assert torch.equal(v_cache.view(-1, kv_heads, dim)[slots], new_v)
    q = qkv[:, : heads * dim].view(-1, heads, dim).float()
    for i, (table, n) in enumerate(zip(tables, lens, strict=True)):
        k = k_cache[table].flatten(0, 1)[:n].float().transpose(0, 1)
        v = v_cache[table].flatten(0, 1)[:n].float().transpose(0, 1)
        want = F.scaled_dot_product_attention(q[i][:, None], k, v, scale=dim**-0.5, enable_gqa=True)[:, 0]
        torch.testing.assert_close(out[i].float().view(heads, dim), want, **_tol(dtype))


@pytest.mark.skipif(os.environ.get("INFLIGHT_NATIVE_KERNELS") == "0", reason="INFLIGHT_NATIVE_KERNELS=0")
@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_decode_steps_take_the_pointer_path_and_match_transformers(arch, monkeypatch, tiny_model_factory,
                                                                   hf_model_factory):  # fmt: skip
    """The tiny model's matmuls are below the small-matmul bound (F.linear, no fused matrix): lifted
    here so the fused outputs exist and every step takes the pointer path."""
    monkeypatch.setattr(linear_module, "_SMALL_ROWS", 0)
    calls = []
    real = common.paged_attention_qkv
    monkeypatch.setattr(common, "paged_attention_qkv", lambda *a: calls.append(a[6].native_only) or real(*a))
    model_dir = tiny_model_factory(arch)
    engine = LLMEngine(EngineConfig(model=str(model_dir), block_size=8))
    prompts, max_tokens = [[5, 6, 7], list(range(20, 41)), [9] * 12], 10
    outputs = engine.generate(
        prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    )
    layers = engine.model.config.num_hidden_layers
    # every step (the prefill too: its short chunks are native kernel rows), every layer
    assert len(calls) == max_tokens * layers and all(calls)
    hf = hf_model_factory(model_dir)
    for prompt, out in zip(prompts, outputs, strict=True):
        tokens, logprobs = hf_greedy(hf, prompt, max_tokens)
        assert out.output_token_ids == tokens
        torch.testing.assert_close(torch.tensor(out.logprobs), torch.tensor(logprobs), atol=1e-4, rtol=0)
