"""Token log-probabilities from the final hidden states, a chunk of tokens at a time
(`trainer.logprobs_chunk_size`), so the [tokens, vocabulary] float32 logits never exist at once.

With a 151,936-token vocabulary one float32 row of logits is 0.6 MB: 1,024 tokens of logits are
622 MB, and the plain computation (`inflight.train.losses.token_logprobs`) holds several such
tensors (the logits, their temperature-scaled copy, the log-softmax kept for the backward, and as
many gradients). Here each chunk's LM head, log-softmax and gather run under activation
checkpointing: the forward keeps only the chunk's hidden states, and the backward recomputes one
chunk's logits at a time (the LM head's matmul runs once more per chunk, the price of the memory).
The arithmetic per token is the plain computation's, so the values and the gradients are equal.
Asked for it (`entropy=True`), each chunk also gives the token entropy of its distributions from the
same log-softmax, under the same checkpoint: the entropy bonus never materialises the full logits
either.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from inflight.engine.request import scaling_temperature


def _chunk_logprobs(lm_head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor,
                    temperature: float) -> torch.Tensor:
    scaled = lm_head(hidden).float() / temperature
    return torch.log_softmax(scaled, dim=-1).gather(-1, targets[:, None]).squeeze(-1)


def _chunk_logprobs_entropy(lm_head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor,
                            temperature: float) -> torch.Tensor:
    log_p = torch.log_softmax(lm_head(hidden).float() / temperature, dim=-1)
    picked = log_p.gather(-1, targets[:, None]).squeeze(-1)
    return torch.stack([picked, -(log_p.exp() * log_p).sum(-1)])


def chunked_token_logprobs(hidden: torch.Tensor, lm_head: torch.nn.Module, input_ids: torch.Tensor,
                           temperature: float = 1.0, chunk_size: int | None = 1024,
                           entropy: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """[B, T] log-probabilities of each token given its prefix (position 0 is 0), from the final
    hidden states [B, T, H] and the LM head, `chunk_size` tokens at a time: what
    `token_logprobs(lm_head(hidden), input_ids, temperature)` gives, without the full logits. With
    `entropy`, also the [B, T] token entropy (`losses.token_entropy`), with its gradient."""
    batch, length = input_ids.shape
    states = hidden[:, :-1].reshape(-1, hidden.shape[-1])
    targets = input_ids[:, 1:].reshape(-1).to(states.device)
    out = state_logprobs(states, targets, lm_head, temperature, chunk_size, entropy)
    if not entropy:
        return F.pad(out.reshape(batch, length - 1), (1, 0))
    picked, ent = (F.pad(x.reshape(batch, length - 1), (1, 0)) for x in out)
    return picked, ent


def state_logprobs(
    states: torch.Tensor,
    targets: torch.Tensor,
    lm_head: torch.nn.Module,
    temperature: float = 1.0,
    chunk_size: int | None = 1024,
    entropy: bool = False,
) -> torch.Tensor:
    """[N] log-probabilities of `targets` [N] under the distributions the LM head gives the hidden
    states [N, H], `chunk_size` states at a time under activation checkpointing (None: all at once,
    no recompute); with `entropy`, [2, N]: those and the distributions' entropy."""
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    temp = scaling_temperature(temperature)
    fn = _chunk_logprobs_entropy if entropy else _chunk_logprobs
    step = max(len(states), 1) if chunk_size is None else chunk_size
    recompute = torch.is_grad_enabled() and chunk_size is not None
    parts = []
    for start in range(0, states.shape[0], step):
        h, t = states[start : start + step], targets[start : start + step]
        parts.append(
            checkpoint(fn, lm_head, h, t, temp, use_reentrant=False) if recompute else fn(lm_head, h, t, temp)
        )
    if not parts:
        return states.new_zeros(2, 0) if entropy else states.new_zeros(0)
    return torch.cat(parts, dim=1 if entropy else 0)
