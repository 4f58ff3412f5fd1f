"""Sampling: greedy, temperature, top-k, top-p, per-request seeds, logprob of each sampled token and,
for requests that ask, the most likely alternatives (`top_logprobs`) and the prompt's scores
(`score_tokens`, for `prompt_logprobs`).

Seeded requests draw from their own generator, one draw per sampled token, so their tokens do not
depend on what else is in the batch; unseeded requests share the engine's generator.
"""

from __future__ import annotations

import torch

from inflight.engine.request import SamplingParams, scaling_temperature


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


TopLogprobs = list[tuple[int, float]]


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    default_generator: torch.Generator,
) -> tuple[list[int], list[float | None], list[TopLogprobs | None]]:
    """Sample one token per row of `logits` [N, V] (float32). Returns (token ids, logprobs, top
    logprobs); a request that did not ask for logprobs (or top logprobs) gets None there, and nothing
    is computed for it. Both are of the temperature-scaled distribution before top-k/top-p."""
    temps = [scaling_temperature(p.temperature) for p in params]
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
    lps, tops = _logprobs(scaled, params, token_list)
    return token_list, lps, tops


def _logprobs(
    scaled: torch.Tensor, params: list[SamplingParams], tokens: list[int]
) -> tuple[list[float | None], list[TopLogprobs | None]]:
    """log_softmax of each asking row at its sampled token, and its top-k, without writing the
    [N, V] log-probabilities: x[i] - logsumexp(x). The top-k values go through the same
    subtraction, so a sampled token that is among them has bit for bit the same logprob."""
    lps: list[float | None] = [None] * len(params)
    tops: list[TopLogprobs | None] = [None] * len(params)
    wanted = [row for row, p in enumerate(params) if p.logprobs]
    if not wanted:
        return lps, tops
    device = scaled.device
    rows = scaled if len(wanted) == len(params) else scaled[torch.tensor(wanted, device=device)]
    lse = torch.logsumexp(rows, dim=-1)
    idx = torch.tensor([tokens[row] for row in wanted], device=device)
    picked = rows.gather(1, idx[:, None]).squeeze(1) - lse
    for row, lp in zip(wanted, picked.tolist(), strict=True):
        lps[row] = lp
    asking = [i for i, row in enumerate(wanted) if params[row].top_logprobs > 0]
    if asking:
        sub = torch.tensor(asking, device=device)
        k = min(max(params[wanted[i]].top_logprobs for i in asking), rows.shape[-1])
        values, ids = torch.topk(rows[sub], k, dim=-1)
        values_list, ids_list = (values - lse[sub][:, None]).tolist(), ids.tolist()
        for j, i in enumerate(asking):
            want = params[wanted[i]].top_logprobs
            tops[wanted[i]] = list(zip(ids_list[j][:want], values_list[j][:want], strict=True))
    return lps, tops


def score_tokens(
    logits: torch.Tensor, targets: list[int], k: int
) -> tuple[list[float], list[int], list[TopLogprobs] | None]:
    """Prompt logprobs: each row's log-probability of `targets[row]` under log_softmax(logits) (no
    temperature), its rank (1 + the tokens more likely), and with k > 0 each row's k most likely
    (token_id, logprob), most likely first. Computed as x - logsumexp(x), as `_logprobs` does."""
    lse = torch.logsumexp(logits, dim=-1)
    idx = torch.tensor(targets, device=logits.device)
    target_logits = logits.gather(1, idx[:, None])
    picked = (target_logits.squeeze(1) - lse).tolist()
    ranks = ((logits > target_logits).sum(-1) + 1).tolist()
    if k <= 0:
        return picked, ranks, None
    values, ids = torch.topk(logits, min(k, logits.shape[-1]), dim=-1)
    values_list, ids_list = (values - lse[:, None]).tolist(), ids.tolist()
    return picked, ranks, [list(zip(i, v, strict=True)) for i, v in zip(ids_list, values_list, strict=True)]
