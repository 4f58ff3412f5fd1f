"""Attention over the paged KV cache, correct for mixed batches.

A step's new tokens are laid out decodes first (one token per sequence), then prefill chunks. New
keys and values are written into the cache at `slot_mapping`. Decodes attend through one of two
backends chosen when the metadata is built:

- `native` (CPU): one call of the C kernel in `inflight.engine.kernels` per layer walks each
  sequence's block table in place: nothing is gathered and nothing grows with the context. Prefill
  chunks of up to `NATIVE_PREFILL_MAX_TOKENS` context tokens go through the same call: their new
  keys are in the cache before attention runs, so each of their tokens is one more row, attending
  to its own prefix through the sequence's table.
- `torch` (any device, and the CPU fallback): decodes are sorted by context length and cut into
  groups of similar length; each group gathers its blocks with one `index_select` into a reused
  workspace and attends in one batched SDPA with a length mask.

Other prefill chunks attend causally with SDPA (gathering their cached context when there is one).
Metadata is built once per step and shared by every layer.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

DECODE_GROUP_SIZE = 16
# Up to this many context tokens a prefill chunk runs row by row in the native kernel; above it
# SDPA's blocked causal attention reads each key fewer times and wins (measured: even at 512, 0.7x at
# 1024, 0.6x at 2048; below 512 the native rows are 1.0-1.1x alone, and skip a call per chunk).
NATIVE_PREFILL_MAX_TOKENS = 512
_KV_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}


@dataclass
class DecodeGroup:
    start: int  # offset of the group's first token in the step's flattened tokens
    count: int  # sequences in the group (one new token each)
    width: int  # blocks per sequence after padding to the group's longest
    block_ids: torch.Tensor  # [count * width] flat block ids (padding repeats block 0)
    mask: torch.Tensor  # [count, 1, 1, width * block_size] True where a key is in the context


@dataclass
class NativeDecode:
    """The native kernel's view of the step: one row per decode, then one per token of the prefill
    chunks (a row of a chunk that SDPA handles has context length 0 and is skipped)."""

    lib: ctypes.CDLL
    count: int
    block_tables: torch.Tensor  # [count, max_blocks] int32, padded with block 0
    context_lens: torch.Tensor  # [count] int32
    max_context: int
    # the scratch every layer of the step shares, (floats, data pointer), taken by the first layer
    scratch: tuple[int, int] | None = None


@dataclass
class PrefillChunk:
    start: int  # offset of the chunk's first token in the step's flattened tokens
    length: int  # number of new tokens
    context_len: int  # tokens in the cache after this step (computed before + new)
    block_ids: torch.Tensor | None = None  # blocks covering context_len; None when nothing is cached
    mask: torch.Tensor | None = None  # [length, context_len] causal mask with offset
    native: bool = False  # attended by the native kernel (rows of NativeDecode)


class Workspace:
    """Buffers reused across layers and steps; they only grow."""

    def __init__(self) -> None:
        self.buffers: dict[str, torch.Tensor] = {}

    def take(self, name: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A flat buffer of at least `numel` elements (the first `numel` are returned)."""
        buf = self.buffers.get(name)
        if buf is None or buf.numel() < numel or buf.dtype != dtype or buf.device != device:
            size = max(numel, 2 * buf.numel() if buf is not None else 0)
            buf = self.buffers[name] = torch.empty(size, dtype=dtype, device=device)
        return buf[:numel]

    def get(self, num_blocks: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Two [num_blocks, block elements] gather buffers shaped like rows of `like` (a 2-D cache view)."""
        numel = num_blocks * like.shape[1]
        return tuple(self.take(name, numel, like.dtype, like.device).view(num_blocks, like.shape[1])
                     for name in ("gather_k", "gather_v"))


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] flat slot index (block_id * block_size + offset) per new token
    decode_groups: list[DecodeGroup] = field(default_factory=list)
    native: NativeDecode | None = None
    prefills: list[PrefillChunk] = field(default_factory=list)
    workspace: Workspace = field(default_factory=Workspace)

    @property
    def native_only(self) -> bool:
        """Whether the native kernel attends every row (nothing for the gather + SDPA path)."""
        return self.native is not None and not self.decode_groups and all(c.native for c in self.prefills)


def build_metadata(
    slot_mapping: list[int],
    decode_tables: list[list[int]],
    decode_context_lens: list[int],
    prefills: list[PrefillChunk],
    prefill_tables: list[list[int]],
    block_size: int,
    device: torch.device,
    workspace: Workspace | None = None,
    native_lib: ctypes.CDLL | None = None,
) -> AttentionMetadata:
    """Turn the scheduler's per-request lists into tensors, once per step. With `native_lib` (CPU
    only) decodes use the native kernel; otherwise they must come in descending context length (the
    runner sorts them) so that groups pad little."""
    meta = AttentionMetadata(torch.tensor(slot_mapping, dtype=torch.long, device=device))
    if workspace is not None:
        meta.workspace = workspace
    if native_lib is not None:
        for chunk in prefills:
            chunk.native = chunk.context_len <= NATIVE_PREFILL_MAX_TOKENS
        if decode_tables or any(chunk.native for chunk in prefills):
            meta.native = _native_rows(
                native_lib, decode_tables, decode_context_lens, prefills, prefill_tables
            )
    else:
        meta.decode_groups = _decode_groups(decode_tables, decode_context_lens, block_size, device)
    for chunk, table in zip(prefills, prefill_tables, strict=True):
        if not chunk.native and chunk.context_len > chunk.length:
            chunk.block_ids = torch.tensor(table, dtype=torch.long, device=device)
            q_pos = torch.arange(chunk.length, device=device)[:, None] + (chunk.context_len - chunk.length)
            chunk.mask = torch.arange(chunk.context_len, device=device)[None, :] <= q_pos
    meta.prefills = prefills
    return meta


def _native_rows(
    lib: ctypes.CDLL,
    decode_tables: list[list[int]],
    decode_lens: list[int],
    prefills: list[PrefillChunk],
    prefill_tables: list[list[int]],
) -> NativeDecode:
    """Rows for the native kernel: each decode, then each token of each prefill chunk (attending to
    the chunk's cached context and the chunk up to itself; 0 for chunks left to SDPA)."""
    tables = decode_tables + prefill_tables
    width = max(len(t) for t in tables)
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    lens, row_tables = list(decode_lens), list(range(len(decode_tables)))
    for i, chunk in enumerate(prefills):
        first = chunk.context_len - chunk.length + 1
        lens += range(first, chunk.context_len + 1) if chunk.native else [0] * chunk.length
        row_tables += [len(decode_tables) + i] * chunk.length
    block_tables = padded[torch.tensor(row_tables)] if prefills else padded
    context_lens = torch.tensor(lens, dtype=torch.int32)
    return NativeDecode(lib, len(lens), block_tables, context_lens, max(lens))


def _decode_groups(tables: list[list[int]], lens: list[int], block_size: int, device) -> list[DecodeGroup]:
    groups = []
    for start in range(0, len(tables), DECODE_GROUP_SIZE):
        group_tables = tables[start : start + DECODE_GROUP_SIZE]
        group_lens = lens[start : start + DECODE_GROUP_SIZE]
        width = max(len(t) for t in group_tables)
        flat = [b for t in group_tables for b in t + [0] * (width - len(t))]
        positions = torch.arange(width * block_size, device=device)
        mask = positions[None, :] < torch.tensor(group_lens, device=device)[:, None]
        groups.append(DecodeGroup(
            start, len(group_tables), width, torch.tensor(flat, dtype=torch.long, device=device),
            mask[:, None, None, :],
        ))  # fmt: skip
    return groups


def _gather(cache_2d: torch.Tensor, block_ids: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    return torch.index_select(cache_2d, 0, block_ids, out=out[: block_ids.numel()])


def rows_of_heads(x: torch.Tensor) -> bool:
    """x [T, heads, D] whose rows hold contiguous heads (a column slice of a wider matrix is fine)."""
    return x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.shape[2]


def _native_attention(
    q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float, out: torch.Tensor
) -> None:
    """One kernel call: write the step's new keys/values into the caches, then attend the native
    rows (decodes and short prefill chunks) into the same rows of `out`."""
    if not q.dtype == k.dtype == v.dtype == k_cache.dtype == v_cache.dtype:
        raise RuntimeError(
            f"native attention needs q/k/v in the cache's dtype {k_cache.dtype}, not {q.dtype}"
        )
    if not (rows_of_heads(q) and rows_of_heads(k) and rows_of_heads(v) and k.stride(0) == v.stride(0)):
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    _run_native(meta, q.data_ptr(), q.stride(0), k.data_ptr(), v.data_ptr(), k.stride(0), k_cache, v_cache,
                out.data_ptr(), q.shape[1], k_cache.shape[2], q.shape[2], scale)  # fmt: skip


def _run_native(
    meta: AttentionMetadata, q: int, q_stride: int, k: int, v: int, kv_stride: int, k_cache: torch.Tensor,
    v_cache: torch.Tensor, out: int, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
) -> None:
    """The kernel call on raw pointers (rows `q_stride` / `kv_stride` elements apart, heads
    contiguous in a row, all in the cache's dtype). The scratch is taken once per step: every layer
    of a step has the same shape."""
    nd = meta.native
    threads = torch.get_num_threads()
    numel = threads * num_heads * (nd.max_context + 2 * head_dim)
    if nd.scratch is None or nd.scratch[0] != numel:
        nd.scratch = (
            numel,
            meta.workspace.take("native_scratch", numel, torch.float32, k_cache.device).data_ptr(),
        )
    status = nd.lib.paged_attention_rows(
        q, q_stride, k, v, kv_stride, meta.slot_mapping.data_ptr(), meta.slot_mapping.numel(),
        k_cache.data_ptr(), v_cache.data_ptr(), nd.block_tables.data_ptr(), nd.context_lens.data_ptr(), out,
        nd.scratch[1], nd.count, num_heads, num_kv_heads, head_dim, k_cache.shape[1],
        nd.block_tables.shape[1], nd.max_context, scale, _KV_DTYPE_CODES[k_cache.dtype], threads,
    )  # fmt: skip
    if status != 0:
        raise RuntimeError(f"native paged attention failed with status {status}")


def paged_attention_qkv(
    qkv: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """`paged_attention` on a fused q|k|v matrix [T, (H + 2 KVH) * D] (rotary already applied);
    returns [T, H * D]. On a step the native kernel attends entirely (every decode step), q, k and
    v go to it as pointers into `qkv`: no views, no copies."""
    kv_width = num_kv_heads * head_dim
    q_width = num_heads * head_dim
    n, width = qkv.shape
    if not (meta.native_only and qkv.is_contiguous() and qkv.dtype == k_cache.dtype == v_cache.dtype
            and width == q_width + 2 * kv_width):  # fmt: skip
        q = qkv[:, :q_width].view(n, num_heads, head_dim)
        k = qkv[:, q_width : q_width + kv_width].view(n, num_kv_heads, head_dim)
        v = qkv[:, q_width + kv_width :].view(n, num_kv_heads, head_dim)
        return paged_attention(q, k, v, k_cache, v_cache, meta, scale).view(n, q_width)
    out = torch.empty(n, q_width, dtype=qkv.dtype)
    q = qkv.data_ptr()
    k = q + q_width * qkv.element_size()
    _run_native(meta, q, width, k, k + kv_width * qkv.element_size(), width, k_cache, v_cache, out.data_ptr(),
                num_heads, num_kv_heads, head_dim, scale)  # fmt: skip
    return out


def native_supports(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the native decode kernel handles a KV cache of this dtype on this device."""
    return device.type == "cpu" and dtype in _KV_DTYPE_CODES


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """q [T, H, D], k/v [T, KVH, D]; caches [blocks, block_size, KVH, D]. Returns [T, H, D]."""
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if meta.native is not None:
        _native_attention(q, k, v, k_cache, v_cache, meta, scale, out)
        if meta.native_only:  # a decode step: nothing below applies
            return out
    else:
        k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, k)
        v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, v)
    k_rows, v_rows = k_cache.view(k_cache.shape[0], -1), v_cache.view(v_cache.shape[0], -1)
    gathered = max([g.block_ids.numel() for g in meta.decode_groups]
                   + [c.block_ids.numel() for c in meta.prefills if c.block_ids is not None] + [0])
    k_buf, v_buf = meta.workspace.get(gathered, k_rows) if gathered else (None, None)
    for g in meta.decode_groups:
        kd = _gather(k_rows, g.block_ids, k_buf).view(g.count, -1, num_kv_heads, head_dim).transpose(1, 2)
        vd = _gather(v_rows, g.block_ids, v_buf).view(g.count, -1, num_kv_heads, head_dim).transpose(1, 2)
        sl = slice(g.start, g.start + g.count)
        o = F.scaled_dot_product_attention(
            q[sl].unsqueeze(2), kd, vd, attn_mask=g.mask, scale=scale, enable_gqa=True
        )
        out[sl] = o.squeeze(2)
    for chunk in meta.prefills:
        if chunk.native:
            continue
        sl = slice(chunk.start, chunk.start + chunk.length)
        qs = q[sl].transpose(0, 1).unsqueeze(0)
        if chunk.block_ids is None:  # nothing cached before: attend to the chunk itself
            ks, vs = k[sl].transpose(0, 1)[None], v[sl].transpose(0, 1)[None]
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=True)
        else:
            n = chunk.context_len
            ks = (
                _gather(k_rows, chunk.block_ids, k_buf)
                .view(-1, num_kv_heads, head_dim)[:n]
                .transpose(0, 1)[None]
            )
            vs = (
                _gather(v_rows, chunk.block_ids, v_buf)
                .view(-1, num_kv_heads, head_dim)[:n]
                .transpose(0, 1)[None]
            )
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=chunk.mask, scale=scale, enable_gqa=True)
        out[sl] = o[0].transpose(0, 1)
    return out
