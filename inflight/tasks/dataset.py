"""Users' own data: a JSONL file of prompts and answers, scored by exact match.

Each line is an object with `prompt` (a string, or a list of chat messages `{"role", "content"}`)
and `answer` (a string or number); `id` is optional (default: the line number). A string prompt is
wrapped as one user message when the tokenizer has a chat template and `chat_template` is on.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from inflight.tasks.base import Problem, Task


class DatasetError(ValueError):
    """A dataset file is missing or malformed (the message names the file and line)."""


def load_jsonl(path: str | Path, prefix: str | None = None) -> list[Problem]:
    """Problems from a JSONL file; raises DatasetError naming the first bad line."""
    path = Path(path)
    if not path.is_file():
        raise DatasetError(f"dataset file {str(path)!r} does not exist")
    prefix = prefix if prefix is not None else path.stem
    problems: list[Problem] = []
    ids: set[str] = set()
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise DatasetError(f"{path}:{number}: not valid JSON ({err})") from err
        if not isinstance(row, dict) or "prompt" not in row or "answer" not in row:
            raise DatasetError(f"{path}:{number}: each line needs an object with 'prompt' and 'answer'")
        prompt = row["prompt"]
        if not (isinstance(prompt, str) or _is_messages(prompt)):
            raise DatasetError(f"{path}:{number}: 'prompt' must be a string or a list of chat messages")
        pid = str(row.get("id", f"{prefix}-{number}"))
        if pid in ids:
            raise DatasetError(f"{path}:{number}: duplicate id {pid!r}")
        ids.add(pid)
        problems.append(Problem(pid, prompt, str(row["answer"])))
    if not problems:
        raise DatasetError(f"dataset file {str(path)!r} holds no problems")
    return problems


def _is_messages(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(m, dict) and "role" in m and "content" in m for m in value)


class JsonlTask(Task):
    """A task from JSONL files: `train_path` (and optionally `eval_path`; else the first
    `num_eval` training problems are held out). Reward: 1 when the response, stripped, equals the
    answer (`match="exact"`) or contains it (`match="contains"`)."""

    name = "jsonl"

    def __init__(
        self,
        tokenizer: Any,
        train_path: str | Path,
        eval_path: str | Path | None = None,
        num_eval: int = 200,
        max_new_tokens: int = 256,
        match: str = "exact",
        chat_template: bool = True,
    ) -> None:
        super().__init__(tokenizer)
        if match not in ("exact", "contains"):
            raise ValueError(f"match={match!r} must be 'exact' or 'contains'")
        problems = load_jsonl(train_path)
        if eval_path is not None:
            self._train, self._eval = problems, load_jsonl(eval_path)
        else:
            self._eval, self._train = problems[:num_eval], problems[num_eval:] or problems
        self.max_new_tokens = max_new_tokens
        self.match = match
        self.chat_template = chat_template and getattr(tokenizer, "chat_template", None) is not None

    def train_problems(self) -> Sequence[Problem]:
        return self._train

    def eval_problems(self) -> Sequence[Problem]:
        return self._eval

    def reward(self, problem: Problem, response: str) -> float:
        got, want = response.strip(), problem.answer.strip()
        return 1.0 if (got == want if self.match == "exact" else want in got) else 0.0

    def encode_prompt(self, prompt: str | list[dict[str, str]]) -> list[int]:
        if not self.chat_template:
            if not isinstance(prompt, str):
                raise DatasetError("chat-message prompts need a tokenizer with a chat template")
            return self.encode(prompt)
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return [int(t) for t in ids]
