"""Shared pieces of the rollout tests: a client that returns scripted turns (the only fake: the
sampling), SkyRL-format data rows written to parquet, token helpers."""

from __future__ import annotations

from pathlib import Path

import datasets
from scripted_client import ScriptedClient, encode  # noqa: F401 (the tests import them from here)


def skyrl_rows(env_class: str, n: int = 4, **columns) -> list[dict]:
    """SkyRL's GSM8K-style rows: chat prompt, env_class, reward_spec, extra_info, plus `columns`."""
    return [{"data_source": "gsm8k", "prompt": [{"role": "user", "content": f"What is {i} + 1?"}],
             "env_class": env_class, "reward_spec": {"method": "rule", "ground_truth": str(i + 1)},
             "extra_info": {"split": "train", "index": i}, **columns} for i in range(n)]


def write_parquet(path: Path, rows: list[dict]) -> Path:
    datasets.Dataset.from_list(rows).to_parquet(str(path))
    return path
