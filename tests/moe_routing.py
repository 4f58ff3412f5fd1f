"""The experts transformers' own routers choose: the oracle of the MoE routing-record tests."""

from __future__ import annotations

import numpy as np
import torch


@torch.no_grad()
def hf_routing(model, tokens: list[int]) -> np.ndarray:
    """[positions, MoE layers, top_k] experts transformers' routers choose for `tokens`."""
    seen = []
    gates = [layer.mlp.gate for layer in model.model.layers if hasattr(layer.mlp, "experts")]
    hooks = [g.register_forward_hook(lambda m, i, out: seen.append(out[2])) for g in gates]
    try:
        model(torch.tensor([tokens]))
    finally:
        for hook in hooks:
            hook.remove()
    return torch.stack(seen, dim=1).numpy()  # each router sees the [tokens, hidden] rows
