"""Token log-probabilities and pluggable losses `loss_fn(logprobs, batch) -> scalar`.

`logprobs[b, t]` is log p(input_ids[b, t] | input_ids[b, :t]) under the trained policy (position 0
is 0), so every loss reads the batch's tensors at the same positions.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from inflight.algorithms import entropy_from_logits, masked_mean
from inflight.engine.request import scaling_temperature
from inflight.train.batch import TrainBatch

LossFn = Callable[..., torch.Tensor]
"""`loss_fn(logprobs, batch) -> scalar`; one whose `wants_entropy` attribute is true also takes
`entropy=` (per-token [B, T], aligned like the log-probabilities)."""


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """[B, T] log-probabilities of each token given its prefix, from [B, T, V] logits (float32,
    temperature-scaled like the engine's `logprobs`); position 0 is 0."""
    scaled = logits[:, :-1].float() / scaling_temperature(temperature)
    picked = torch.log_softmax(scaled, dim=-1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    return F.pad(picked, (1, 0))


def token_entropy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """[B, T] entropy of the temperature-scaled distribution each token was drawn from (position t:
    the distribution predicting token t, as `token_logprobs`; position 0 is 0), from [B, T, V] logits."""
    return F.pad(entropy_from_logits(logits[:, :-1].float() / scaling_temperature(temperature)), (1, 0))


def token_mean_nll_loss(logprobs: torch.Tensor, batch: TrainBatch) -> torch.Tensor:
    """Token-mean negative log-likelihood of the masked tokens (supervised fine-tuning). The RL
    objective is `inflight.train.objective.rl_loss`."""
    return -masked_mean(logprobs, batch.loss_mask)
