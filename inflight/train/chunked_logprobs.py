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
                           temperature: float = 1.0, chunk_size: int = 1024,
                           entropy: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """[B, T] log-probabilities of each token given its prefix (position 0 is 0), from the final
    hidden states [B, T, H] and the LM head, `chunk_size` tokens at a time: what
    `token_logprobs(lm_head(hidden), input_ids, temperature)` gives, without the full logits. With
    `entropy`, also the [B, T] token entropy (`losses.token_entropy`), with its gradient."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    batch, length = input_ids.shape
    states = hidden[:, :-1].reshape(-1, hidden.shape[-1])
    targets = input_ids[:, 1:].reshape(-1).to(states.device)
    temp = scaling_temperature(temperature)
    fn = _chunk_logprobs_entropy if entropy else _chunk_logprobs
    recompute = torch.is_grad_enabled()
    parts = []
    for start in range(0, states.shape[0], chunk_size):
        h, t = states[start : start + chunk_size], targets[start : start + chunk_size]
        parts.append(checkpoint(fn, lm_head, h, t, temp, use_reentrant=False) if recompute else fn(lm_head, h, t, temp))
    if not entropy:
        picked = torch.cat(parts).reshape(batch, length - 1) if parts else states.new_zeros(batch, length - 1)
        return F.pad(picked, (1, 0))
    both = torch.cat(parts, dim=1) if parts else states.new_zeros(2, 0)
    picked, ent = (F.pad(x.reshape(batch, length - 1), (1, 0)) for x in both)
    return picked, ent
