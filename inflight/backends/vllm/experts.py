"""A mixture of experts' expert weights under transformers 5's fused names, staged under a checkpoint's
per-expert names.

Published Qwen2-MoE / Qwen3-MoE checkpoints name each expert's weights
(`<p>.mlp.experts.{e}.gate_proj.weight`, `up_proj`, `down_proj`), while transformers 5 holds them
fused, and a trainer's `state_dict()` sends them so: `<p>.mlp.experts.gate_up_proj` [E, 2 * I, H]
(each expert's gate rows, then its up rows) and `<p>.mlp.experts.down_proj` [E, H, I]. Against a
checkpoint with per-expert names, a fused tensor is checked against the shape its parts make and
staged as those parts (views), so an update is complete by the checkpoint's names and vLLM reloads
its own per-expert layout. (A checkpoint that already has fused names, as the trainer's HF export
writes, takes them as they are.)
"""

from __future__ import annotations

import re
from typing import Any

_PER_EXPERT = re.compile(
    r"^(?P<experts>.+\.mlp\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$"
)
_FUSED = re.compile(r"^(?P<experts>.+\.mlp\.experts)\.(?P<kind>gate_up_proj|down_proj)$")


class FusedExperts:
    """The fused names a checkpoint's per-expert weights make, with their shapes and parts."""

    def __init__(self, params: dict[str, dict[str, Any]]) -> None:
        found: dict[str, dict[int, set[str]]] = {}
        for name in params:
            m = _PER_EXPERT.match(name)
            if m:
                found.setdefault(m["experts"], {}).setdefault(int(m["e"]), set()).add(m["proj"])
        self.specs: dict[str, dict[str, Any]] = {}
        self.shapes: dict[str, list[int]] = {}
        for experts, by_index in found.items():
            count = len(by_index)
            if set(by_index) != set(range(count)) or any(len(p) != 3 for p in by_index.values()):
                continue  # not the layout this class knows: only the checkpoint's own names are taken
            width, hidden = params[f"{experts}.0.gate_proj.weight"]["shape"]
            self.shapes[f"{experts}.gate_up_proj"] = [count, 2 * width, hidden]
            self.shapes[f"{experts}.down_proj"] = [count, hidden, width]
            self.specs[f"{experts}.gate_up_proj"] = self.specs[f"{experts}.down_proj"] = \
                params[f"{experts}.0.gate_proj.weight"]

    def shape(self, name: str) -> list[int] | None:
        """The shape a fused name's tensor must have; None when the name is no fused expert weight."""
        return self.shapes.get(name)

    def split(self, name: str, tensor: Any) -> list[tuple[str, Any]]:
        """A fused tensor as the checkpoint's per-expert tensors (views); other names as they are."""
        m = _FUSED.match(name)
        if m is None or name not in self.shapes:
            return [(name, tensor)]
        experts = m["experts"]
        if m["kind"] == "down_proj":
            return [(f"{experts}.{e}.down_proj.weight", tensor[e]) for e in range(tensor.shape[0])]
        width = tensor.shape[1] // 2
        return [
            part
            for e in range(tensor.shape[0])
            for part in (
                (f"{experts}.{e}.gate_proj.weight", tensor[e, :width]),
                (f"{experts}.{e}.up_proj.weight", tensor[e, width:]),
            )
        ]
