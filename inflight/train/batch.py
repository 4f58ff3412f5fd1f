"""TrainBatch: the token-level tensors one training step consumes."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch


@dataclass
class TrainBatch:
    """Sequences of one rank's share of a training step, every tensor aligned with `input_ids`.

    - `input_ids` [B, T]: prompt + response tokens (right-padded).
    - `loss_mask` [B, T]: 1 where the token's log-probability counts in the loss (response tokens);
      position 0 is never predicted and must be 0.
    - `attention_mask` [B, T]: 1 for real tokens (default: all ones).
    - `advantages` [B] or [B, T]: per-sequence or per-token advantages (policy-gradient losses).
    - `old_logprobs` [B, T]: log-probabilities under the policy that sampled the tokens (the
      engine's `logprobs`), for the PPO ratio; absent means on-policy (ratio 1).
    """

    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    attention_mask: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    old_logprobs: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, seq], got shape {tuple(self.input_ids.shape)}")
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None and value.shape[0] != self.input_ids.shape[0]:
                raise ValueError(
                    f"{f.name} has {value.shape[0]} rows, input_ids has {self.input_ids.shape[0]}"
                )

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def split(self, size: int) -> list[TrainBatch]:
        """Micro-batches of at most `size` sequences, in order."""
        return [self.select(slice(i, i + size)) for i in range(0, len(self), size)]

    def select(self, rows: slice | torch.Tensor) -> TrainBatch:
        """The rows `rows` (a slice, or a tensor of row indices) of every tensor."""
        return replace(
            self, **{f.name: v[rows] for f in fields(self) if (v := getattr(self, f.name)) is not None}
        )

    def to(self, device: torch.device | str) -> TrainBatch:
        return replace(
            self, **{f.name: v.to(device) for f in fields(self) if (v := getattr(self, f.name)) is not None}
        )
