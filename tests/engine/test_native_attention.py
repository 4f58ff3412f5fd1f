"""The native decode-attention kernel against torch's SDPA on the same paged KV, and its selection."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from inflight.engine import EngineConfig, LLMEngine, attention, kernels
from inflight.engine.attention import PrefillChunk, Workspace, build_metadata, paged_attention
from inflight.engine.errors import InvalidRequestError

needs_kernel = pytest.mark.skipif(
    kernels.load() is None, reason="no C compiler: the native kernel cannot be built"
)


def _paged_case(seed: int, heads: int, kv_heads: int, head_dim: int, block: int, lens: list[int], dtype):
    """A cache with each sequence's blocks scattered at random, plus the contiguous reference K/V."""
    gen = torch.Generator().manual_seed(seed)
    tables, free = [], list(range(1, 1 + sum(-(-n // block) for n in lens)))
    random.Random(seed).shuffle(free)
    for n in lens:
        tables.append([free.pop() for _ in range(-(-n // block))])
    num_blocks = 1 + max(b for t in tables for b in t)
    k_cache = torch.randn(num_blocks, block, kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block, kv_heads, head_dim, generator=gen).to(dtype)
    q = torch.randn(len(lens), heads, head_dim, generator=gen)
    return q, k_cache, v_cache, tables


def _reference(q, k_cache, v_cache, tables, lens, scale):
    out = []
    for i, (table, n) in enumerate(zip(tables, lens, strict=True)):
        k = k_cache[table].flatten(0, 1)[:n].float().transpose(0, 1)  # [KVH, n, D]
        v = v_cache[table].flatten(0, 1)[:n].float().transpose(0, 1)
        o = F.scaled_dot_product_attention(q[i][:, None], k, v, scale=scale, enable_gqa=True)
        out.append(o[:, 0])
    return torch.stack(out)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,block",
    [(8, 2, 64, 16), (4, 4, 32, 4), (2, 1, 128, 16), (6, 1, 16, 8), (4, 2, 48, 8), (8, 4, 64, 24),
     (4, 2, 64, 128), (2, 1, 8, 16), (2, 2, 40, 16)],
)  # with AVX-512, head sizes 16..128 in steps of 16 take the 16-token-tile path (blocks of 24 end
# inside a tile), with AVX2 16, 32, 48, 64 and 128 the 8-token one; 8 and 40 take the any-size path,
# as do all sizes in the portable build
def test_kernel_equals_sdpa_on_scattered_blocks(dtype, heads, kv_heads, head_dim, block, lib):
    lens = [1, 2, block, block + 1, 37, 100, 3 * block - 1]
    q, k_cache, v_cache, tables = _paged_case(0, heads, kv_heads, head_dim, block, lens, dtype)
    scale = head_dim**-0.5
    width = max(len(t) for t in tables)
    meta = build_metadata([], tables, lens, [], [], block, torch.device("cpu"),
                          Workspace(), lib)  # fmt: skip
    assert meta.native is not None and meta.native.block_tables.shape == (len(lens), width)
    out = torch.empty(len(lens), heads, head_dim, dtype=dtype)
    no_new = torch.empty(0, kv_heads, head_dim, dtype=dtype)  # every key is in the cache already
    attention._native_attention(q.to(dtype), no_new, no_new, k_cache, v_cache, meta, scale, out)
    expected = _reference(q.to(dtype).float(), k_cache, v_cache, tables, lens, scale)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)


@needs_kernel
@pytest.mark.parametrize("prefill_limit", [1024, 6, 0])
def test_native_and_torch_paths_agree_in_a_mixed_step(prefill_limit, monkeypatch, lib):
    """Decodes, a prefill chunk with cached context and one without, through the kernel (prefill
    rows up to `prefill_limit` context tokens, SDPA above) and through gather + SDPA."""
    monkeypatch.setattr(attention, "NATIVE_PREFILL_MAX_TOKENS", prefill_limit)
    heads, kv_heads, head_dim, block = 4, 2, 16, 4
    lens = [5, 9, 22, 3]
    q, k_cache, v_cache, tables = _paged_case(1, heads, kv_heads, head_dim, block, lens, torch.float32)
    cached_table = [b + 40 for b in range(3)]  # 3 more blocks for a 10-token context, 4 new tokens
    fresh_table = [43, 44]  # a 5-token prompt, nothing cached
    k_cache = torch.cat([k_cache, torch.randn(45 - k_cache.shape[0], block, kv_heads, head_dim)])
    v_cache = torch.cat([v_cache, torch.randn(45 - v_cache.shape[0], block, kv_heads, head_dim)])
    n_tokens = len(lens) + 4 + 5
    qs = torch.randn(n_tokens, heads, head_dim)
    ks, vs = torch.randn(n_tokens, kv_heads, head_dim), torch.randn(n_tokens, kv_heads, head_dim)
    slots = [tables[i][(n - 1) // block] * block + (n - 1) % block for i, n in enumerate(lens)]
    slots += [cached_table[p // block] * block + p % block for p in range(6, 10)]
    slots += [fresh_table[p // block] * block + p % block for p in range(5)]
    results = []
    for native in (lib, None):
        chunks = [PrefillChunk(len(lens), 4, 10), PrefillChunk(len(lens) + 4, 5, 5)]
        meta = build_metadata(slots, tables, lens, chunks, [cached_table, fresh_table], block,
                              torch.device("cpu"), Workspace(), native)  # fmt: skip
        if native is not None:
            assert [c.native for c in chunks] == [10 <= prefill_limit, 5 <= prefill_limit]
        kc, vc = k_cache.clone(), v_cache.clone()
        results.append(paged_attention(qs, ks, vs, kc, vc, meta, head_dim**-0.5))
    torch.testing.assert_close(results[0], results[1], atol=1e-5, rtol=1e-5)


def test_backend_is_validated(tiny_model_factory):
    with pytest.raises(InvalidRequestError, match="attention_backend='fast' must be one of"):
        LLMEngine(EngineConfig(model=str(tiny_model_factory("qwen2")), attention_backend="fast"))


def test_native_refuses_an_unsupported_cache_dtype(tiny_model_factory):
    with pytest.raises(kernels.NativeKernelError, match="float32/bfloat16"):
        LLMEngine(
            EngineConfig(model=str(tiny_model_factory("qwen2")), dtype="float16", attention_backend="native")
        )


def test_disabled_kernels_fall_back_or_fail_loudly(tiny_model_factory, monkeypatch):
    model = str(tiny_model_factory("qwen2"))
    monkeypatch.setenv("INFLIGHT_NATIVE_KERNELS", "0")
    monkeypatch.setattr(kernels, "_LOADED", {})
    assert LLMEngine(EngineConfig(model=model)).runner.native_lib is None
    with pytest.raises(kernels.NativeKernelError, match="INFLIGHT_NATIVE_KERNELS=0"):
        LLMEngine(EngineConfig(model=model, attention_backend="native"))


def test_kernel_builds_into_a_fresh_cache(tmp_path, monkeypatch):
    monkeypatch.delenv("INFLIGHT_NATIVE_KERNELS", raising=False)  # a test of the loader itself
    if kernels._compiler() is None:
        pytest.skip("no C compiler")
    monkeypatch.setenv("INFLIGHT_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setattr(kernels, "_LOADED", {})
    assert kernels.load(required=True) is not None
    assert kernels.library_path().parent == tmp_path and kernels.library_path().is_file()
    assert [p.name for p in tmp_path.iterdir()] == [kernels.library_path().name]  # no temp left over


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,block",
    [(4, 2, 64, 12), (3, 1, 128, 20), (2, 2, 16, 12), (6, 3, 32, 20), (2, 1, 48, 12)],
)
def test_kernel_on_blocks_that_end_inside_a_tile(dtype, heads, kv_heads, head_dim, block, lib):
    """Blocks of 12 and 20 end inside an 8-token (AVX2) and a 16-token (AVX-512) tile, for every head
    size with a tiled instance; the contexts of 37 and 100 end inside a tile too."""
    test_kernel_equals_sdpa_on_scattered_blocks(dtype, heads, kv_heads, head_dim, block, lib)
