"""The engine's two memory pools: the paged KV cache and the model weights, each able to sleep.

`KVCache` holds one tensor [layers, 2, blocks, block_size, kv_heads, head_dim]. Sleeping either moves
it to host memory (restored bit-identically, same block ids) or discards it (the engine then starts
a new KV epoch in the BlockPool, so that the scheduler finds requests whose KV no longer exists).
`WeightsPool` drops and re-creates the model's parameters; non-parameter buffers (rotary tables) are never
touched.
"""

from __future__ import annotations

import torch
from torch import nn

from inflight.engine.models.linear import invalidate_packed


class KVCache:
    """Paged key/value storage for every layer."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.shape = (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)
        self.dtype = dtype
        self.device = device
        self.tensor: torch.Tensor | None = torch.zeros(self.shape, dtype=dtype, device=device)
        self._host_copy: torch.Tensor | None = None
        # (k, v) views of each layer, made once per tensor: indexing costs microseconds per layer
        # and step; dropped with the tensor on sleep (they would keep its memory alive)
        self._views: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._views_of: torch.Tensor | None = None

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype) -> int:
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * block_size * num_kv_heads * head_dim * itemsize

    @property
    def awake(self) -> bool:
        return self.tensor is not None

    @property
    def nbytes(self) -> int:
        return self.tensor.nbytes if self.tensor is not None else 0

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        tensor = self.tensor
        if self._views_of is not tensor:
            assert tensor is not None, "KV cache is asleep"
            self._views = [(layer[0], layer[1]) for layer in tensor.unbind(0)]
            self._views_of = tensor
        return self._views[index]

    def sleep(self, offload: bool) -> None:
        """Release the device tensor; keep a host copy when `offload`, else discard the contents."""
        if self.tensor is None:
            if not offload:  # discarding an offloaded pool
                self._host_copy = None
            return
        if offload:
            on_host = self.tensor.device.type == "cpu"
            self._host_copy = self.tensor if on_host else self.tensor.to("cpu")
        self.tensor = None
        self._views, self._views_of = [], None

    def wake_up(self) -> None:
        """Bring the pool back at the same block ids (bit-identical if it was offloaded)."""
        if self.tensor is not None:
            return
        if self._host_copy is not None:
            self.tensor = self._host_copy.to(self.device)
            self._host_copy = None
        else:
            self.tensor = torch.zeros(self.shape, dtype=self.dtype, device=self.device)


class WeightsPool:
    """Drops and re-creates a module's parameters in place; buffers are kept."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.awake = True
        self._specs = {name: (p.shape, p.dtype, p.device) for name, p in model.named_parameters()}

    def sleep(self) -> None:
        for _, param in self.model.named_parameters():
            param.data = torch.empty(0, dtype=param.dtype, device=param.device)
        invalidate_packed(self.model)  # packed copies of the weights go with them
        self.awake = False

    def wake_up(self) -> None:
        """Re-allocate every parameter (uninitialised: a full weight update must follow)."""
        if self.awake:
            return
        for name, param in self.model.named_parameters():
            shape, dtype, device = self._specs[name]
            param.data = torch.empty(shape, dtype=dtype, device=device)
        invalidate_packed(self.model)
        self.awake = True

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for _, p in self.model.named_parameters())
