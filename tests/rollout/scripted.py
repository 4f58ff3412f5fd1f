"""Shared pieces of the rollout tests: a client that returns scripted turns (the only fake: the
sampling), SkyRL-format data rows written to parquet, token helpers."""

from __future__ import annotations

from pathlib import Path

import datasets

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
    return list(tok(text, add_special_tokens=False)["input_ids"])


def skyrl_rows(env_class: str, n: int = 4, **columns) -> list[dict]:
    """SkyRL's GSM8K-style rows: chat prompt, env_class, reward_spec, extra_info, plus `columns`."""
    return [{"data_source": "gsm8k", "prompt": [{"role": "user", "content": f"What is {i} + 1?"}],
             "env_class": env_class, "reward_spec": {"method": "rule", "ground_truth": str(i + 1)},
             "extra_info": {"split": "train", "index": i}, **columns} for i in range(n)]


def write_parquet(path: Path, rows: list[dict]) -> Path:
    datasets.Dataset.from_list(rows).to_parquet(str(path))
    return path
