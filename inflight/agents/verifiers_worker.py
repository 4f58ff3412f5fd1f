"""A verifiers environment's side of a run, as a script in verifiers' own venv (`.venv-verifiers`).

It imports nothing from `inflight` (that venv does not have it): the standard library, verifiers and
openai only. The environment is one `verifiers.load_environment(env_id, **env_args)` (the legacy API
of verifiers 0.1.x, the one SkyRL's integration drives: an installed module named after the id, with
a `load_environment` function). Run it with `-P` so that this folder's modules do not shadow others.

`python -P verifiers_worker.py serve ENV_ID [--env-args JSON]` plays episodes. It reads one JSON
request a line on stdin, `{"id", "base_url", "api_key", "model", "input"}` (`input`: the
environment's row, `{"prompt", "answer", "example_id", "task", "info"}`), runs each at once with
the environment's `generate` on that one input, the model being `AsyncOpenAI(base_url, api_key)`,
and answers one JSON line on stdout per request: `{"id", "reward", "metrics"}` (the rubric's reward
and its reward functions' values) or `{"id", "error"}`. Its first line is `{"ready": true,
"verifiers": VERSION}`, or `{"ready": false, "error"}` when the environment cannot be loaded. It
stops at the end of stdin. Anything else written to stdout (the environment's prints) goes to
stderr.

`python -P verifiers_worker.py dataset ENV_ID --output DIR [--env-args JSON] [--num-train N]
[--num-eval N]` writes the environment's own data as a run reads it: `DIR/train.jsonl` (its
dataset) and `DIR/validation.jsonl` (its eval dataset, when it has one), one row a line: `id`,
`prompt` (the environment's, system prompt included), `answer` and `verifiers` (`example_id`,
`task`, `info`: what the episode's input needs back). It prints the rows written per file as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any, TextIO


def load(env_id: str, env_args: dict[str, Any]) -> Any:
    """The environment `env_id` made with `env_args` (verifiers' own loader)."""
    import verifiers

    return verifiers.load_environment(env_id, **env_args)


def _plain(value: Any) -> Any:
    """A rubric's value as JSON can hold it (numbers as floats)."""
    if isinstance(value, bool | int | float):
        return float(value)
    return value if isinstance(value, str | type(None)) else str(value)


def episode_input(env: Any, row: dict[str, Any]) -> dict[str, Any]:
    """The environment's input for a row: a text prompt is one user message for a chat environment."""
    row = dict(row)
    if env.message_type == "chat" and isinstance(row["prompt"], str):
        row["prompt"] = [{"role": "user", "content": row["prompt"]}]
    elif env.message_type == "completion" and not isinstance(row["prompt"], str):
        raise ValueError(
            "the environment completes text (message_type='completion'): its rows' prompts must be "
            "text, not chat messages"
        )
    return row


async def rollout(env: Any, request: dict[str, Any]) -> dict[str, Any]:
    """One episode of `env` on `request["input"]` against the request's OpenAI endpoint."""
    from openai import AsyncOpenAI

    inputs = [episode_input(env, request["input"])]
    client = AsyncOpenAI(base_url=request["base_url"], api_key=request["api_key"], max_retries=0)
    try:
        out = await env.generate(inputs=inputs, client=client, model=request["model"], use_tqdm=False)
    finally:
        await client.close()
    metrics = {str(k): _plain(v[0]) for k, v in (out["metrics"] or {}).items() if v}
    return {"reward": float(out["reward"][0]), "metrics": metrics}


class Replies:
    """The protocol's stdout: one JSON object a line, flushed (the process's own stdout goes to stderr)."""

    def __init__(self) -> None:
        self.out: TextIO = os.fdopen(os.dup(sys.stdout.fileno()), "w", encoding="utf-8")
        sys.stdout.flush()
        os.dup2(sys.stderr.fileno(), sys.stdout.fileno())

    def send(self, message: dict[str, Any]) -> None:
        self.out.write(json.dumps(message) + "\n")
        self.out.flush()


async def answer(env: Any, line: str, replies: Replies) -> None:
    request_id = None
    try:
        request = json.loads(line)
        request_id = request.get("id")
        replies.send({"id": request_id, **await rollout(env, request)})
    except Exception as err:  # the episode's failure, told to the run; the worker goes on
        replies.send({"id": request_id, "error": f"{type(err).__name__}: {err}"})


async def serve(env_id: str, env_args: dict[str, Any]) -> int:
    replies = Replies()
    try:
        env = load(env_id, env_args)
    except Exception as err:
        replies.send({"ready": False, "error": f"{type(err).__name__}: {err}"})
        return 1
    import verifiers

    replies.send({"ready": True, "verifiers": verifiers.__version__})
    loop = asyncio.get_running_loop()
    pending: set[asyncio.Task[None]] = set()
    while line := await loop.run_in_executor(None, sys.stdin.readline):
        if line.strip():
            task = asyncio.create_task(answer(env, line, replies))
            pending.add(task)
            task.add_done_callback(pending.discard)
    for task in list(pending):
        task.cancel()
    return 0


def dataset_rows(data: Any, split: str) -> list[dict[str, Any]]:
    """The rows of one of the environment's datasets, as a run reads them."""
    rows = []
    for number, row in enumerate(data.to_list()):
        example_id = row.get("example_id", number)
        rows.append(
            {
                "id": f"{split}-{example_id}",
                "prompt": row["prompt"],
                "answer": row.get("answer") or "",
                "verifiers": {
                    "example_id": example_id,
                    "task": row.get("task") or "default",
                    "info": row.get("info") or {},
                },
            }
        )
    return rows


def write_dataset(
    env_id: str, env_args: dict[str, Any], output: Path, num_train: int, num_eval: int
) -> dict[str, int]:
    env = load(env_id, env_args)
    splits = {"train": env.get_dataset(num_train) if env.dataset is not None else None,
              "validation": env.get_eval_dataset(num_eval) if env.eval_dataset is not None else None}
    output.mkdir(parents=True, exist_ok=True)
    written = {}
    for split, data in splits.items():
        if data is None:
            continue
        path = output / f"{split}.jsonl"
        rows = dataset_rows(data, split)
        path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
        written[str(path)] = len(rows)
    return written


def _env_args(text: str) -> dict[str, Any]:
    value = json.loads(text)
    if not isinstance(value, dict):
        raise SystemExit(f"--env-args must be a JSON object (the loader's keyword arguments), got {text!r}")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="verifiers_worker.py", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("serve", "dataset"):
        cmd = sub.add_parser(name)
        cmd.add_argument("env_id")
        cmd.add_argument("--env-args", type=_env_args, default={})
    data = sub.choices["dataset"]
    data.add_argument("--output", type=Path, required=True)
    data.add_argument("--num-train", type=int, default=-1, help="rows of the dataset (-1: all)")
    data.add_argument("--num-eval", type=int, default=-1, help="rows of the eval dataset (-1: all)")
    args = parser.parse_args(argv)
    if args.command == "serve":
        return asyncio.run(serve(args.env_id, args.env_args))
    print(json.dumps(write_dataset(args.env_id, args.env_args, args.output, args.num_train, args.num_eval)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
