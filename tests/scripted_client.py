"""A client that returns scripted turns (the only fake of the rollout and environment tests: the
sampling), and the tokenizing helper those tests share."""

from __future__ import annotations

from inflight.engine.request import RequestOutput


class ScriptedClient:
    """Returns the given turns' token ids in order (logprob -0.5, weight version 7) and records every
    prompt it was sent: what the model saw."""

    def __init__(self, turns: list[tuple[list[int], str]]) -> None:
        self.turns, self.prompts = list(turns), []

    async def generate(self, prompt_token_ids, params=None, **_):
        self.prompts.append(list(prompt_token_ids))
        ids, finish = self.turns.pop(0)
        return RequestOutput("r", list(prompt_token_ids), ids, [-0.5] * len(ids), [7] * len(ids), finish)


def encode(tok, text: str) -> list[int]:
    """`text`'s token ids without special tokens."""
    return list(tok(text, add_special_tokens=False)["input_ids"])
