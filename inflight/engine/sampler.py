"""Sampling: greedy, temperature, top-k, top-p, per-request seeds, logprob of each sampled token.

Seeded requests draw from their own generator, one draw per sampled token, so their tokens do not
depend on what else is in the batch; unseeded requests share the engine's generator.
"""

from __future__ import annotations

import torch

from inflight.engine.request import SamplingParams


def _filter(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask (to -inf) everything outside the top-k and the top-p nucleus of one row."""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # keep a token if the mass before it is below top_p (the top token is always kept)
        drop = (probs.cumsum(-1) - probs) >= top_p
        logits = logits.clone()
        logits[order[drop]] = float("-inf")
    return logits


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    default_generator: torch.Generator,
) -> tuple[list[int], list[float | None]]:
    """Sample one token per row of `logits` [N, V] (float32). Returns (token ids, logprobs); a
    request that did not ask for logprobs gets None (nothing computed for it)."""
    temps = [p.temperature if p.temperature > 0 else 1.0 for p in params]
    scaled = logits
    if any(t != 1.0 for t in temps):  # dividing by 1.0 changes nothing: skip a pass over [N, V]
        scaled = logits / torch.tensor(temps, dtype=logits.dtype, device=logits.device)[:, None]
    tokens = scaled.argmax(dim=-1).cpu()
    for row, (p, gen) in enumerate(zip(params, generators, strict=True)):
        if p.greedy:
            continue
        filtered = _filter(scaled[row], p.top_k, p.top_p)
        probs = filtered.softmax(-1).cpu()
        # exponential race: argmax(p / E) with E ~ Exp(1) is a sample from p
        noise = torch.empty_like(probs).exponential_(generator=gen or default_generator)
        tokens[row] = (probs / noise).argmax()
    token_list = tokens.tolist()
    wanted = [row for row, p in enumerate(params) if p.logprobs]
    lps: list[float | None] = [None] * len(params)
    if wanted:
        rows = scaled if len(wanted) == len(params) else scaled[torch.tensor(wanted, device=logits.device)]
        idx = torch.tensor([token_list[row] for row in wanted], device=logits.device)
        # log_softmax at one index: x[i] - logsumexp(x), without writing the [N, V] log-probabilities
        picked = rows.gather(1, idx[:, None]).squeeze(1) - torch.logsumexp(rows, dim=-1)
        for row, lp in zip(wanted, picked.tolist(), strict=True):
            lps[row] = lp
    return token_list, lps
