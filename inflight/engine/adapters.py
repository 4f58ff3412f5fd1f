"""LoRA adapters as weight updates: the engine keeps the base weights and merges each adapter into them.

An adapter update carries, for each adapted linear layer `<m>`, `<m>.lora_A.weight` [rank, in] and
`<m>.lora_B.weight` [out, rank] with the adapter's scaling (alpha / rank) already in B, instead of
`<m>.weight`. At `finish_weight_update` every adapted weight becomes `W0 + B @ A` (in float32, then
the engine's dtype), where `W0` is an untouched copy of the base weight taken the first time an
adapter touches it; a weight an earlier adapter changed and this one leaves out goes back to `W0`.
Merging in place keeps the forward, the packed matmuls, every KV fate and the prefix-cache
versioning exactly as for a full update, and a sync moves only the adapter's bytes. A full update
replaces the base: the copies are dropped.
"""

from __future__ import annotations

import torch

from inflight.engine.errors import WeightUpdateError

LORA_A = ".lora_A.weight"
LORA_B = ".lora_B.weight"


def adapter_part(hf_name: str) -> tuple[str, str] | None:
    """(`<m>.weight`, "A" or "B") for an adapter tensor's name, None for any other name."""
    for suffix, part in ((LORA_A, "A"), (LORA_B, "B")):
        if hf_name.endswith(suffix):
            return hf_name[: -len(suffix)] + ".weight", part
    return None


class AdapterMerger:
    """The base copies `W0` of the weights adapters have touched, and the merge."""

    def __init__(self) -> None:
        self.base: dict[str, torch.Tensor] = {}

    def check(self, hf_name: str, tensor: torch.Tensor, weight: torch.Tensor | None) -> tuple[str, str]:
        """Refuse an adapter tensor that does not fit the weight it adapts; returns (weight, part)."""
        target = adapter_part(hf_name)
        assert target is not None
        name, part = target
        if weight is None or weight.dim() != 2:
            raise WeightUpdateError(f"adapter tensor {hf_name!r}: the model has no linear weight {name!r}")
        out_features, in_features = weight.shape
        ok = tensor.dim() == 2 and (
            tensor.shape[1] == in_features if part == "A" else tensor.shape[0] == out_features
        )
        if not ok:
            side = f"[rank, {in_features}]" if part == "A" else f"[{out_features}, rank]"
            raise WeightUpdateError(
                f"adapter tensor {hf_name!r} has shape {tuple(tensor.shape)}, expected {side}"
            )
        return name, part

    def merged(
        self, params: dict[str, torch.Tensor], pieces: dict[str, dict[str, torch.Tensor]]
    ) -> dict[str, torch.Tensor]:
        """The new value of every weight this adapter or an earlier one touched: `W0 + B @ A`, or
        `W0` where this adapter leaves the weight out. Raises before anything is kept when a
        weight has only one of A and B, or their ranks differ."""
        for name, parts in pieces.items():
            if set(parts) != {"A", "B"}:
                missing = "lora_B" if "A" in parts else "lora_A"
                raise WeightUpdateError(f"adapter for {name!r} lacks its {missing} tensor")
            if parts["A"].shape[0] != parts["B"].shape[1]:
                raise WeightUpdateError(
                    f"adapter for {name!r}: lora_A has rank {parts['A'].shape[0]}, "
                    f"lora_B {parts['B'].shape[1]}"
                )
        base = dict(self.base)
        for name in pieces:
            if name not in base:
                base[name] = params[name].detach().clone()
        out = {}
        for name, w0 in base.items():
            parts = pieces.get(name)
            if parts is None:
                out[name] = w0
                continue
            out[name] = torch.addmm(w0.float(), parts["B"], parts["A"]).to(w0.dtype)  # one fused pass
        self.base = base
        return out

    def forget(self) -> None:
        """A full update replaced the base weights: the copies no longer hold them."""
        self.base = {}
