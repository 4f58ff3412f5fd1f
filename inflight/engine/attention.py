"""Attention over the paged KV cache in plain PyTorch (SDPA), correct for mixed batches.

A step's new tokens are laid out decodes first (one token per sequence, sorted by context length
and cut into groups of similar length so padding stays small), then prefill chunks. New keys and
values are written into the cache at `slot_mapping`. Each decode group gathers its blocks with one
`index_select` into a reused workspace (no fresh allocation proportional to the context) and
attends in one batched SDPA with a length mask; each prefill chunk attends causally with its offset.
Metadata is built once per step and shared by every layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

DECODE_GROUP_SIZE = 16


@dataclass
class DecodeGroup:
    start: int  # offset of the group's first token in the step's flattened tokens
    count: int  # sequences in the group (one new token each)
    width: int  # blocks per sequence after padding to the group's longest
    block_ids: torch.Tensor  # [count * width] flat block ids (padding repeats block 0)
    mask: torch.Tensor  # [count, 1, 1, width * block_size] True where a key is in the context


@dataclass
class PrefillChunk:
    start: int  # offset of the chunk's first token in the step's flattened tokens
    length: int  # number of new tokens
    context_len: int  # tokens in the cache after this step (computed before + new)
    block_ids: torch.Tensor | None = None  # blocks covering context_len; None when nothing is cached
    mask: torch.Tensor | None = None  # [length, context_len] causal mask with offset


class Workspace:
    """Gather buffers reused across layers and steps; they only grow."""

    def __init__(self) -> None:
        self.buffers: tuple[torch.Tensor, torch.Tensor] | None = None

    def get(self, num_blocks: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Two [num_blocks, block elements] buffers shaped like rows of `like` (a 2-D cache view)."""
        if self.buffers is None or self.buffers[0].shape[0] < num_blocks or self.buffers[0].dtype != like.dtype:
            rows = max(num_blocks, 2 * (self.buffers[0].shape[0] if self.buffers else 0))
            self.buffers = tuple(torch.empty(rows, like.shape[1], dtype=like.dtype, device=like.device)
                                 for _ in range(2))
        return self.buffers[0][:num_blocks], self.buffers[1][:num_blocks]


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] flat slot index (block_id * block_size + offset) per new token
    decode_groups: list[DecodeGroup] = field(default_factory=list)
    prefills: list[PrefillChunk] = field(default_factory=list)
    workspace: Workspace = field(default_factory=Workspace)

    @property
    def num_decode(self) -> int:
        return sum(g.count for g in self.decode_groups)


def build_metadata(
    slot_mapping: list[int],
    decode_tables: list[list[int]],
    decode_context_lens: list[int],
    prefills: list[PrefillChunk],
    prefill_tables: list[list[int]],
    block_size: int,
    device: torch.device,
    workspace: Workspace | None = None,
) -> AttentionMetadata:
    """Turn the scheduler's per-request lists into tensors, once per step. Decodes must come in
    descending context length (the runner sorts them) so that groups pad little."""
    meta = AttentionMetadata(torch.tensor(slot_mapping, dtype=torch.long, device=device))
    if workspace is not None:
        meta.workspace = workspace
    for start in range(0, len(decode_tables), DECODE_GROUP_SIZE):
        tables = decode_tables[start : start + DECODE_GROUP_SIZE]
        lens = decode_context_lens[start : start + DECODE_GROUP_SIZE]
        width = max(len(t) for t in tables)
        flat = [b for t in tables for b in t + [0] * (width - len(t))]
        positions = torch.arange(width * block_size, device=device)
        mask = positions[None, :] < torch.tensor(lens, device=device)[:, None]
        meta.decode_groups.append(DecodeGroup(
            start, len(tables), width, torch.tensor(flat, dtype=torch.long, device=device), mask[:, None, None, :]
        ))
    for chunk, table in zip(prefills, prefill_tables, strict=True):
        if chunk.context_len > chunk.length:
            chunk.block_ids = torch.tensor(table, dtype=torch.long, device=device)
            q_pos = torch.arange(chunk.length, device=device)[:, None] + (chunk.context_len - chunk.length)
            chunk.mask = torch.arange(chunk.context_len, device=device)[None, :] <= q_pos
    meta.prefills = prefills
    return meta


def _gather(cache_2d: torch.Tensor, block_ids: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    return torch.index_select(cache_2d, 0, block_ids, out=out[: block_ids.numel()])


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
    k_rows, v_rows = k_cache.view(k_cache.shape[0], -1), v_cache.view(v_cache.shape[0], -1)
    out = torch.empty_like(q)
    gathered = max([g.block_ids.numel() for g in meta.decode_groups]
                   + [c.block_ids.numel() for c in meta.prefills if c.block_ids is not None] + [0])
    k_buf, v_buf = meta.workspace.get(gathered, k_rows) if gathered else (None, None)
    for g in meta.decode_groups:
        kd = _gather(k_rows, g.block_ids, k_buf).view(g.count, -1, num_kv_heads, head_dim).transpose(1, 2)
        vd = _gather(v_rows, g.block_ids, v_buf).view(g.count, -1, num_kv_heads, head_dim).transpose(1, 2)
        sl = slice(g.start, g.start + g.count)
        o = F.scaled_dot_product_attention(q[sl].unsqueeze(2), kd, vd, attn_mask=g.mask, scale=scale, enable_gqa=True)
        out[sl] = o.squeeze(2)
    for chunk in meta.prefills:
        sl = slice(chunk.start, chunk.start + chunk.length)
        qs = q[sl].transpose(0, 1).unsqueeze(0)
        if chunk.block_ids is None:  # nothing cached before: attend to the chunk itself
            ks, vs = k[sl].transpose(0, 1)[None], v[sl].transpose(0, 1)[None]
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=True)
        else:
            n = chunk.context_len
            ks = _gather(k_rows, chunk.block_ids, k_buf).view(-1, num_kv_heads, head_dim)[:n].transpose(0, 1)[None]
            vs = _gather(v_rows, chunk.block_ids, v_buf).view(-1, num_kv_heads, head_dim)[:n].transpose(0, 1)[None]
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=chunk.mask, scale=scale, enable_gqa=True)
        out[sl] = o[0].transpose(0, 1)
    return out
