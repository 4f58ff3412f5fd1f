"""The `logprobs` objects of the OpenAI responses, from a delta's tokens, logprobs and top logprobs.

Chat (`logprobs=true, top_logprobs=k`): per token `{token, logprob, bytes, top_logprobs}` with
exactly k alternatives, most likely first. Completions (`logprobs=k`): `tokens`, `token_logprobs`,
`text_offset` and `top_logprobs`, per token a map of the k most likely tokens' texts to their
logprobs plus the sampled token (so k + 1 entries when it is not among them, as OpenAI documents).
All are of the temperature-scaled distribution the token was sampled from. With
`return_tokens_as_token_ids` tokens are named `token_id:<id>` (vLLM's spelling), which tells apart
tokens whose text is the same (such as partial UTF-8 sequences).
"""

from __future__ import annotations

from typing import Any

from inflight.server.detokenize import Delta


class TokenNamer:
    """A token's text in logprob entries."""

    def __init__(self, tokenizer: Any, as_ids: bool) -> None:
        self.tokenizer = tokenizer
        self.as_ids = as_ids

    def text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def __call__(self, token_id: int) -> str:
        return f"token_id:{token_id}" if self.as_ids else self.text(token_id)


def _tops(delta: Delta, k: int) -> list[list[tuple[int, float]]]:
    if k <= 0:
        return [[] for _ in delta.token_ids]
    assert delta.top_logprobs is not None and len(delta.top_logprobs) == len(delta.token_ids)
    return delta.top_logprobs


def completion_logprobs(name: TokenNamer, delta: Delta, k: int, offset: int) -> dict[str, Any]:
    """The completions `logprobs` object; `offset` is the text offset of the delta's first token."""
    tokens = [name(t) for t in delta.token_ids]
    logprobs = list(delta.logprobs or [])
    offsets, top = [], []
    for token_id, token, lp, alternatives in zip(delta.token_ids, tokens, logprobs, _tops(delta, k), strict=True):
        offsets.append(offset)
        offset += len(name.text(token_id))
        entry = {name(t): alt for t, alt in alternatives}
        entry.setdefault(token, lp)
        top.append(entry)
    return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": top, "text_offset": offsets}


def _entry(text: str, logprob: float) -> dict[str, Any]:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode())}


def chat_logprobs(name: TokenNamer, delta: Delta, k: int) -> dict[str, Any]:
    """The chat `logprobs` object: `{"content": [...]}`, one entry per token."""
    content = []
    for token_id, lp, alternatives in zip(delta.token_ids, delta.logprobs or [], _tops(delta, k), strict=True):
        top = [_entry(name(t), alt) for t, alt in alternatives]
        content.append({**_entry(name(token_id), lp), "top_logprobs": top})
    return {"content": content}


__all__ = ["TokenNamer", "chat_logprobs", "completion_logprobs"]
