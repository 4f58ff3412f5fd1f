"""The `logprobs` objects of the OpenAI responses, from a delta's tokens, logprobs and top logprobs,
and vLLM's `prompt_logprobs`.

Chat (`logprobs=true, top_logprobs=k`): per token `{token, logprob, bytes, top_logprobs}` with
exactly k alternatives, most likely first; `bytes` are the token's own bytes (`token_bytes.py`), so
joining them rebuilds the text even where a token holds part of a UTF-8 character. Completions
(`logprobs=k`): `tokens`, `token_logprobs`, `text_offset` and `top_logprobs`, per token a map of the
k most likely tokens' texts to their logprobs plus the token itself (so k + 1 entries when it is not
among them, as OpenAI documents); with `echo` the prompt's tokens come first, the first with None
(it has no score) and the others with their prompt scores. Output logprobs are of the
temperature-scaled distribution the token was sampled from, prompt scores of the model's own (T = 1).
With `return_tokens_as_token_ids` tokens are named `token_id:<id>` (vLLM's spelling), which tells
apart tokens whose text is the same (such as partial UTF-8 sequences).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from inflight.server.detokenize import ChoiceTracker, Delta
from inflight.server.token_bytes import TokenBytes

Top = list[tuple[int, float]]


class TokenNamer:
    """A token's text (and bytes) in logprob entries."""

    def __init__(self, tokenizer: Any, as_ids: bool) -> None:
        self.tokenizer = tokenizer
        self.as_ids = as_ids
        self.bytes = TokenBytes(tokenizer)

    def text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def __call__(self, token_id: int) -> str:
        return f"token_id:{token_id}" if self.as_ids else self.text(token_id)


def _tops(delta: Delta, k: int) -> list[Top]:
    if k <= 0:
        return [[] for _ in delta.token_ids]
    assert delta.top_logprobs is not None and len(delta.top_logprobs) == len(delta.token_ids)
    return delta.top_logprobs


def completion_logprobs(name: TokenNamer, token_ids: Sequence[int], logprobs: Sequence[float | None],
                        tops: Sequence[Top | None], offset: int) -> dict[str, Any]:
    """The completions `logprobs` object of these tokens; `offset` is the text offset of the first.
    A token whose logprob is None (the first prompt token) has None in `top_logprobs` too."""
    tokens = [name(t) for t in token_ids]
    offsets, top = [], []
    for token_id, token, lp, alternatives in zip(token_ids, tokens, logprobs, tops, strict=True):
        offsets.append(offset)
        offset += len(name.text(token_id))
        if lp is None:
            top.append(None)
            continue
        entry = {name(t): alt for t, alt in alternatives or []}
        entry.setdefault(token, lp)
        top.append(entry)
    return {"tokens": tokens, "token_logprobs": list(logprobs), "top_logprobs": top, "text_offset": offsets}


def delta_logprobs(name: TokenNamer, delta: Delta, k: int, offset: int) -> dict[str, Any]:
    """`completion_logprobs` of a delta's output tokens (k alternatives each)."""
    return completion_logprobs(name, delta.token_ids, list(delta.logprobs or []), _tops(delta, k), offset)


def prompt_lists(t: ChoiceTracker) -> tuple[list[float | None], list[Top | None]]:
    """The tracker's prompt scores as per-token lists (None where a token has none: the first, or one
    an aborted request never reached)."""
    n = len(t.prompt_token_ids)
    logprobs = list(t.prompt_logprobs or [])[:n]
    tops = list(t.prompt_top_logprobs or [])[:n]
    return logprobs + [None] * (n - len(logprobs)), tops + [None] * (n - len(tops))


def _entry(name: TokenNamer, token_id: int, logprob: float) -> dict[str, Any]:
    return {"token": name(token_id), "logprob": logprob, "bytes": name.bytes(token_id)}


def chat_logprobs(name: TokenNamer, delta: Delta, k: int) -> dict[str, Any]:
    """The chat `logprobs` object: `{"content": [...]}`, one entry per token."""
    content = []
    for token_id, lp, alternatives in zip(
        delta.token_ids, delta.logprobs or [], _tops(delta, k), strict=True
    ):
        top = [_entry(name, t, alt) for t, alt in alternatives]
        content.append({**_entry(name, token_id, lp), "top_logprobs": top})
    return {"content": content}


def vllm_prompt_logprobs(name: TokenNamer, t: ChoiceTracker) -> list[dict[str, Any] | None] | None:
    """vLLM's `prompt_logprobs`: per prompt token None (the first) or a map from token id to
    `{logprob, rank, decoded_token}` holding the prompt token and the k most likely there."""
    if t.prompt_logprobs is None:
        return None
    logprobs, tops = prompt_lists(t)
    ranks = list(t.prompt_logprob_ranks or [])
    out: list[dict[str, Any] | None] = []
    for i, (token_id, lp, alternatives) in enumerate(zip(t.prompt_token_ids, logprobs, tops, strict=True)):
        if lp is None:
            out.append(None)
            continue
        entry = {str(token_id): {"logprob": lp, "rank": ranks[i] if i < len(ranks) else None,
                                 "decoded_token": name(token_id)}}
        for rank, (alt, alt_lp) in enumerate(alternatives or [], start=1):
            entry.setdefault(str(alt), {"logprob": alt_lp, "rank": rank, "decoded_token": name(alt)})
        out.append(entry)
    return out


__all__ = ["TokenNamer", "chat_logprobs", "completion_logprobs", "delta_logprobs", "prompt_lists",
           "vllm_prompt_logprobs"]
