"""Users' own data, read through the `datasets` library: `.parquet`, `.jsonl` / `.json` files and
`datasets.save_to_disk` directories, one `Problem` per row.

Row formats, detected per file from its columns:
- SkyRL's: `prompt` (chat messages), `env_class`, `reward_spec` (`{"method": "rule", "ground_truth": ...}`;
  verl's `reward_model` too, as DAPO's AIME files have), `data_source`, `extra_info`, and whatever
  other columns an environment reads (text2sql's `db_id` and `data`);
- flat: `prompt` (text or chat messages) and `answer`;
- GSM8K's `question` / `answer`, or any other columns named by `prompt_key` / `answer_key`.
An answer holding `####` (GSM8K's reasoning, then `#### 72`) has what follows the last `####` as its
ground truth. `Problem.answer` is the ground truth as text (a structured one, Search-R1's
`{"target": [...]}`, as JSON; environments read it from `extras`); `Problem.meta` holds `ground_truth`,
`env_class` (None when the row has none), `data_source` (default: the file's stem) and `extra_info`
(a dict), `gsm8k_format` (the answer held `####`), `source` (`file:row`) and `extras` (every column
but the prompt and `env_class`: what SkyRL hands an environment as its `extras`). An optional `id`
column names the problems (default: `<file stem>-<row number>`).

Images (SkyRL's multimodal rows): a chat message's content may be a list of parts, text and images
(`image_url` with a data: URL or a path, `image` with bytes, datasets' `{"bytes", "path"}` struct,
base64 text or a path; `inflight.chat.images`). A relative path is read from the data file's folder.
Every image is decoded and checked (`ImageLimits`) as the file is read, and the prompt holds it as
`{"type": "image", "image": <PIL image>}`. A row with a bad image is refused: with `refused` given it
is left out and its reason appended there (the caller counts and reports them), else DatasetError.

`JsonlTask` / `load_jsonl` are the older JSONL-only spellings, kept working.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from inflight.chat.images import ImageError, ImageLimits, count_images, decode_images
from inflight.chat.vision import ImagePrompt
from inflight.tasks.base import Problem, Task

DATA_SUFFIXES = (".parquet", ".jsonl", ".json")
SPEC_COLUMNS = ("reward_spec", "reward_model")
"""Columns holding `{"ground_truth": ...}`: SkyRL's `reward_spec`, verl's `reward_model`."""


class DatasetError(ValueError):
    """A dataset file is missing, unreadable or malformed (the message names the file, row and column)."""


def read_rows(path: str | Path) -> Any:
    """The rows of one data file or `save_to_disk` directory as a `datasets.Dataset`."""
    import datasets

    path = Path(path)
    if not path.exists():
        raise DatasetError(f"dataset file {str(path)!r} does not exist")
    bars = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        return _read(datasets, path)
    finally:
        if bars:
            datasets.enable_progress_bars()


def _read(datasets: Any, path: Path) -> Any:
    if path.is_dir():
        try:
            rows = datasets.load_from_disk(str(path))
        except Exception as err:
            raise DatasetError(
                f"{path}: not a directory written by datasets' save_to_disk ({_root(err)})"
            ) from err
        if isinstance(rows, datasets.DatasetDict):
            splits = ", ".join(rows)
            raise DatasetError(
                f"{path}: holds the splits {splits}; give one split's directory "
                f"(e.g. {path / next(iter(rows))})"
            )
        return rows
    suffix = path.suffix.lower()
    if suffix not in DATA_SUFFIXES:
        raise DatasetError(
            f"{path}: unsupported file type {suffix or '(none)'!r}; use .parquet, .jsonl, .json "
            "or a directory written by datasets' save_to_disk"
        )
    if path.stat().st_size == 0:
        raise DatasetError(f"dataset file {str(path)!r} holds no problems (it is empty)")
    try:
        if suffix == ".parquet":
            return datasets.Dataset.from_parquet(str(path))
        return datasets.Dataset.from_json(str(path))
    except Exception as err:
        if suffix == ".parquet":
            raise DatasetError(f"{path}: not Parquet ({_root(err)})") from err
        # Arrow needs one type per column; JSON rows may mix them (a text prompt here, chat messages
        # there), which the reader below keeps as they are
        return _json_rows(path, err)


class _Rows(list):
    """Rows Arrow cannot hold in one table (mixed types in a column), as plain dicts."""

    @property
    def column_names(self) -> list[str]:
        return list(dict.fromkeys(k for row in self for k in row))


def _json_rows(path: Path, arrow_error: BaseException) -> _Rows:
    text = path.read_text()
    try:
        if path.suffix.lower() == ".json" and text.lstrip().startswith("["):
            rows = json.loads(text)
        else:
            rows = []
            for number, line in enumerate(text.splitlines(), start=1):
                if line.strip():
                    rows.append(_json_line(path, number, line))
    except json.JSONDecodeError as err:
        raise DatasetError(f"{path}: not valid JSON ({err}; Arrow: {_root(arrow_error)})") from err
    if not all(isinstance(r, dict) for r in rows):
        raise DatasetError(f"{path}: each row must be a JSON object")
    return _Rows({k: row.get(k) for k in dict.fromkeys(k for r in rows for k in r)} for row in rows)


def _json_line(path: Path, number: int, line: str) -> Any:
    try:
        return json.loads(line)
    except json.JSONDecodeError as err:
        raise DatasetError(f"{path}: line {number}: not valid JSON ({err})") from err


def _root(err: BaseException) -> str:
    """The innermost cause of a `datasets` error (its own message is generic)."""
    while err.__cause__ is not None or err.__context__ is not None:
        err = err.__cause__ or err.__context__  # type: ignore[assignment]
    return f"{type(err).__name__}: {err}"


def load_problems(
    path: str | Path,
    prompt_key: str | None = None,
    answer_key: str | None = None,
    id_prefix: str | None = None,
    *,
    image_limits: ImageLimits | None = None,
    refused: list[str] | None = None,
) -> list[Problem]:
    """The problems of one data file or directory (formats: see the module docstring). Raises
    DatasetError naming the file, the row (1-based) and the column of the first bad row; a row whose
    image is bad is left out with its reason appended to `refused` when given (`image_limits`: the
    pixel and byte limits; default `ImageLimits()`; any local file may be read)."""
    path = Path(path)
    rows = read_rows(path)
    if len(rows) == 0:
        raise DatasetError(f"dataset file {str(path)!r} holds no problems")
    columns = list(rows.column_names)
    reader = _RowReader(path, columns, prompt_key, answer_key, id_prefix or path.stem)
    limits = image_limits or ImageLimits()
    reader.image_limits = ImageLimits(limits.max_pixels, limits.max_bytes, Path(path.resolve().anchor), True)
    problems, ids, skipped = [], set(), []
    for number, row in enumerate(rows, start=1):
        try:
            problem = reader.problem(number, row)
        except ImageError as err:
            if refused is None:
                raise DatasetError(str(err)) from None
            skipped.append(str(err))
            continue
        if problem.id in ids:
            raise DatasetError(f"{path}: row {number}: duplicate id {problem.id!r} (column 'id')")
        ids.add(problem.id)
        problems.append(problem)
    if skipped and not problems:
        raise DatasetError(f"{path}: every row has a bad image (e.g. {skipped[0]})")
    if refused is not None:
        refused.extend(skipped)
    return problems


class _RowReader:
    """Which columns of one file hold the prompt and the ground truth, and how a row becomes a Problem."""

    def __init__(
        self, path: Path, columns: list[str], prompt_key: str | None, answer_key: str | None, prefix: str
    ) -> None:
        self.path, self.columns, self.prefix = path, columns, prefix
        self.image_limits = ImageLimits()
        self.prompt_col = prompt_key or next((c for c in ("prompt", "question") if c in columns), None)
        if self.prompt_col is None or self.prompt_col not in columns:
            raise self.missing(prompt_key or "prompt", "data.prompt_key", "prompts")
        self.answer_col = answer_key or next((c for c in SPEC_COLUMNS + ("answer",) if c in columns), None)
        if self.answer_col is None or self.answer_col not in columns:
            raise self.missing(answer_key or "answer", "data.answer_key", "answers")

    def missing(self, column: str, key: str, what: str) -> DatasetError:
        return DatasetError(
            f"{self.path}: no column {column!r} (the file has: {', '.join(self.columns)}); rows need "
            f"'prompt' and 'answer', SkyRL's 'prompt' and 'reward_spec.ground_truth', GSM8K's 'question' "
            f"and 'answer', or set {key} to the column that holds the {what}"
        )

    def error(self, number: int, column: str, text: str) -> DatasetError:
        return DatasetError(f"{self.path}: row {number}: column {column!r} {text}")

    def problem(self, number: int, row: dict[str, Any]) -> Problem:
        prompt = _clean_prompt(row.get(self.prompt_col))
        if prompt is None:
            raise self.error(
                number,
                self.prompt_col,
                "must be a string or a list of chat messages "
                f"({{'role', 'content'}}), got {row.get(self.prompt_col)!r}",
            )
        if not isinstance(prompt, str) and count_images(prompt):
            try:
                prompt = decode_images(prompt, self.image_limits, self.path.parent, self.prompt_col)
            except ImageError as err:
                raise ImageError(f"{self.path}: row {number}: column {err}", err.code, err.where) from None
        truth, gsm8k_format = self.ground_truth(number, row)
        extra = row.get("extra_info")
        if extra is not None and not isinstance(extra, dict):
            raise self.error(number, "extra_info", f"must be a mapping, got {type(extra).__name__}")
        env_class = row.get("env_class")
        if env_class is not None and not isinstance(env_class, str):
            raise self.error(number, "env_class", f"must be a string, got {env_class!r}")
        pid = row.get("id")
        meta = {
            "ground_truth": truth,
            "env_class": env_class or None,
            "data_source": row.get("data_source") or self.prefix,
            "extra_info": dict(extra or {}),
            "source": f"{self.path}:{number}",
            "gsm8k_format": gsm8k_format,
            "extras": {k: v for k, v in row.items() if k not in (self.prompt_col, "env_class")},
        }
        return Problem(str(pid) if pid is not None else f"{self.prefix}-{number}", prompt, truth, meta)

    def ground_truth(self, number: int, row: dict[str, Any]) -> tuple[str, bool]:
        """The row's ground truth, and whether it was a GSM8K answer (reasoning, then `#### 72`)."""
        value, column = row.get(self.answer_col), self.answer_col
        spec = column in SPEC_COLUMNS and isinstance(value, dict)
        if spec:
            value, column = value.get("ground_truth"), f"{column}.ground_truth"
        if spec and isinstance(value, dict | list) and value:  # Search-R1's {"target": [...]}: as JSON
            return json.dumps(value, ensure_ascii=False), False
        if value is None or isinstance(value, dict):
            raise self.error(number, column, f"holds no ground truth (got {value!r})")
        text = str(value)
        if not spec and "####" in text:
            return text.rsplit("####", 1)[-1].strip(), True
        return text, False


def _clean_prompt(value: Any) -> str | list[dict[str, Any]] | None:
    """A text prompt, or chat messages (and their content parts) without the None fields Arrow adds
    to unify their structs."""
    if isinstance(value, str):
        return value
    if (
        isinstance(value, list)
        and value
        and all(isinstance(m, dict) and "role" in m and "content" in m for m in value)
    ):
        return [{k: _clean_parts(v) for k, v in m.items() if v is not None} for m in value]
    return None


def _clean_parts(value: Any) -> Any:
    if not isinstance(value, list):
        return value
    return [{k: v for k, v in p.items() if v is not None} if isinstance(p, dict) else p for p in value]


def load_jsonl(path: str | Path, prefix: str | None = None) -> list[Problem]:
    """Problems from a JSONL file of `{"prompt", "answer"}` lines (the older API; `load_problems` reads
    every format). Raises DatasetError naming the file and the bad row."""
    return load_problems(path, id_prefix=prefix)


def encode_chat_prompt(task: Task, prompt: str | list[dict[str, Any]], chat_template: bool) -> list[int]:
    """Token ids of a prompt: through the tokenizer's chat template (a string becomes one user message)
    with the generation prompt, or the plain text when `chat_template` is off."""
    if not chat_template:
        if not isinstance(prompt, str):
            raise DatasetError("chat-message prompts need a tokenizer with a chat template")
        return task.encode(prompt)
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    fmt = task.chat_format
    template = {} if fmt.template is None else {"chat_template": fmt.template}
    if count_images(messages):
        return image_prompt(task, messages).token_ids
    ids = task.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                             **template, **fmt.kwargs)
    if hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return [int(t) for t in ids]


def image_prompt(task: Task, messages: list[dict[str, Any]]) -> ImagePrompt:
    """A prompt holding images through the task's chat template and its model's processor
    (`task.vision`): the ids with the image placeholders expanded, and the image tensors."""
    vision = getattr(task, "vision", None)
    if vision is None:
        raise DatasetError(
            f"a prompt holds {count_images(messages)} image(s), but {type(task).__name__} has no "
            "image processor (a text-only model): give a vision-language model, or text prompts"
        )
    split = vision.split(messages)
    fmt = task.chat_format
    template = {} if fmt.template is None else {"chat_template": fmt.template}
    text = task.tokenizer.apply_chat_template(split.messages, add_generation_prompt=True, tokenize=False,
                                              **template, **fmt.kwargs)
    return vision.expand(text, split.images)


class JsonlTask(Task):
    """A task from JSONL files: `train_path` (and optionally `eval_path`; else the first
    `num_eval` training problems are held out). Reward: 1 when the response, stripped, equals the
    answer (`match="exact"`) or contains it (`match="contains"`). `inflight train` now builds a
    `DataTask` for `job.task=jsonl` (seeded split, lengths, rewards by name); this class stays for
    Python users."""

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
        return encode_chat_prompt(self, prompt, self.chat_template)
