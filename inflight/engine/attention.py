"""Attention over the paged KV cache in plain PyTorch (SDPA), correct for mixed batches.

A step's new tokens are laid out decodes first (one token per sequence), then prefill chunks. Their
keys and values are written into the cache at `slot_mapping`; decodes attend in one batched SDPA over
their gathered blocks with a length mask, each prefill chunk attends causally with its offset.
Masks and block tables are built once per step and shared by every layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class PrefillChunk:
    start: int  # offset of the chunk's first token in the step's flattened tokens
    length: int  # number of new tokens
    context_len: int  # tokens in the cache after this step (computed before + new)
    block_table: torch.Tensor | None = None  # blocks covering context_len; None when nothing is cached
    mask: torch.Tensor | None = None  # [length, context_len] causal mask with offset


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] flat slot index (block_id * block_size + offset) per new token
    num_decode: int = 0
    decode_block_tables: torch.Tensor | None = None  # [B, max_blocks]
    decode_mask: torch.Tensor | None = None  # [B, 1, 1, max_blocks * block_size]
    prefills: list[PrefillChunk] = field(default_factory=list)


def build_metadata(
    slot_mapping: list[int],
    decode_tables: list[list[int]],
    decode_context_lens: list[int],
    prefills: list[PrefillChunk],
    prefill_tables: list[list[int]],
    block_size: int,
    device: torch.device,
) -> AttentionMetadata:
    """Turn the scheduler's per-request lists into tensors, once per step."""
    meta = AttentionMetadata(torch.tensor(slot_mapping, dtype=torch.long, device=device))
    if decode_tables:
        width = max(len(t) for t in decode_tables)
        tables = torch.tensor([t + [0] * (width - len(t)) for t in decode_tables], dtype=torch.long, device=device)
        lens = torch.tensor(decode_context_lens, dtype=torch.long, device=device)
        positions = torch.arange(width * block_size, device=device)
        meta.num_decode = len(decode_tables)
        meta.decode_block_tables = tables
        meta.decode_mask = (positions[None, :] < lens[:, None])[:, None, None, :]
    for chunk, table in zip(prefills, prefill_tables, strict=True):
        if chunk.context_len > chunk.length:
            chunk.block_table = torch.tensor(table, dtype=torch.long, device=device)
            q_pos = torch.arange(chunk.length, device=device)[:, None] + (chunk.context_len - chunk.length)
            chunk.mask = torch.arange(chunk.context_len, device=device)[None, :] <= q_pos
    meta.prefills = prefills
    return meta


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
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, v)
    out = torch.empty_like(q)
    if meta.num_decode:
        n = meta.num_decode
        tables = meta.decode_block_tables
        kd = k_cache[tables].flatten(1, 2).transpose(1, 2)  # [B, KVH, S, D]
        vd = v_cache[tables].flatten(1, 2).transpose(1, 2)
        o = F.scaled_dot_product_attention(
            q[:n].unsqueeze(2), kd, vd, attn_mask=meta.decode_mask, scale=scale, enable_gqa=True
        )
        out[:n] = o.squeeze(2)
    for chunk in meta.prefills:
        sl = slice(chunk.start, chunk.start + chunk.length)
        qs = q[sl].transpose(0, 1).unsqueeze(0)
        if chunk.block_table is None:  # nothing cached before: attend to the chunk itself
            ks, vs = k[sl], v[sl]
            o = F.scaled_dot_product_attention(
                qs, ks.transpose(0, 1)[None], vs.transpose(0, 1)[None], is_causal=True, scale=scale, enable_gqa=True
            )
        else:
            ks = k_cache[chunk.block_table].flatten(0, 1)[: chunk.context_len]
            vs = v_cache[chunk.block_table].flatten(0, 1)[: chunk.context_len]
            o = F.scaled_dot_product_attention(
                qs, ks.transpose(0, 1)[None], vs.transpose(0, 1)[None], attn_mask=chunk.mask, scale=scale,
                enable_gqa=True,
            )
        out[sl] = o[0].transpose(0, 1)
    return out
