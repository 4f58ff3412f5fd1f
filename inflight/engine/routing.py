"""The routing record of a mixture-of-experts model: which experts computed each token.

Every forward writes, beside each token's KV, the experts each MoE layer chose for that token
(`RoutingCache`: [KV slots, MoE layers, top-k] small integers, one row per KV slot). A slot's row is
therefore always the routing of the forward whose keys and values the slot holds: a prefix-cache hit
reads the rows of the request that computed the block, and a recomputed position (preemption, the
`recompute` KV fate, the epoch backstop) has the rows of its recomputation, under the weights that
recomputed it. A request's record is read out of its block table when it finishes:
`RequestOutput.routed_experts[i]` is the routing of position `routed_experts_start + i` of
prompt + output, up to the last position with KV (every token but the last sampled one).

On the wire (HTTP token route) a record is `encode_routed_experts`' JSON object: start, shape, dtype
and the array's C-order bytes in base64.
"""

from __future__ import annotations

import base64
from typing import Any

import numpy as np
import torch

from inflight.engine.models.common import DecoderForCausalLM
from inflight.engine.models.moe import routing_dtype

# torch keeps int16, the record is unsigned (expert ids >= 0): vLLM's uint8 / uint16
_NUMPY = {torch.uint8: np.uint8, torch.int16: np.uint16}


class RoutingCache:
    """One row of expert ids per KV slot, written by every forward of an MoE model."""

    def __init__(self, num_slots: int, num_moe_layers: int, top_k: int, dtype: torch.dtype,
                 block_size: int, device: torch.device) -> None:
        self.rows = torch.zeros((num_slots, num_moe_layers, top_k), dtype=dtype, device=device)
        self.block_size = block_size

    @classmethod
    def for_model(cls, model: DecoderForCausalLM, num_slots: int, block_size: int,
                  device: torch.device) -> RoutingCache | None:
        """The cache for `model`'s routing; None for a dense model."""
        shape = model.routing_shape
        if shape is None:
            return None
        dtype = routing_dtype(model.moe_blocks[0].num_experts)
        return cls(num_slots, *shape, dtype, block_size, device)

    def buffer(self, num_tokens: int) -> torch.Tensor:
        """Where one forward's MoE layers write the routing of its `num_tokens` tokens."""
        return torch.empty((num_tokens, *self.rows.shape[1:]), dtype=self.rows.dtype, device=self.rows.device)

    def store(self, slot_mapping: torch.Tensor, routing: torch.Tensor) -> None:
        """Keep a forward's routing beside the KV it wrote (`slot_mapping`: each token's KV slot)."""
        self.rows.index_copy_(0, slot_mapping, routing)

    def read(self, block_ids: list[int], start: int, end: int) -> np.ndarray:
        """The rows of positions [start, end) of a block table, [n, MoE layers, top_k] (uint8 or uint16)."""
        positions = torch.arange(start, max(start, end), device=self.rows.device)
        table = torch.tensor(block_ids, dtype=torch.long, device=self.rows.device)
        slots = table[positions // self.block_size] * self.block_size + positions % self.block_size
        rows = self.rows.index_select(0, slots).cpu().numpy()
        return rows.view(_NUMPY[self.rows.dtype])


def encode_routed_experts(record: np.ndarray | None, start: int) -> dict[str, Any] | None:
    """A record as JSON: {"start", "shape", "dtype", "data": base64 of its C-order bytes}."""
    if record is None:
        return None
    return {"start": start, "shape": list(record.shape), "dtype": record.dtype.name,
            "data": base64.b64encode(np.ascontiguousarray(record).tobytes()).decode("ascii")}


def decode_routed_experts(data: dict[str, Any] | None) -> tuple[np.ndarray | None, int]:
    """(record, start) from `encode_routed_experts`' object; (None, 0) for None. ValueError on a
    malformed object (a dtype other than uint8/uint16, bytes that do not fill the shape)."""
    if data is None:
        return None, 0
    if data.get("dtype") not in ("uint8", "uint16"):
        raise ValueError(f"routed_experts dtype {data.get('dtype')!r} must be uint8 or uint16")
    flat = np.frombuffer(base64.b64decode(data["data"]), dtype=data["dtype"])
    shape = tuple(int(n) for n in data["shape"])
    if len(shape) != 3 or flat.size != int(np.prod(shape)):
        raise ValueError(f"routed_experts of shape {list(shape)} cannot hold {flat.size} values")
    return flat.reshape(shape), int(data["start"])
