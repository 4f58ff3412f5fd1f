"""`job:` — the settings of an `inflight train` run that the SkyRL-named schema has no key for.

The task and its data, run length, warm-up of the built-in base model, where outputs go, threads,
and logging; the old spellings of schema keys (`ALIASES`: `job.eval_interval`, `job.tis`, ...) are
forwarded to those keys. It lives in its own section so the shared schema
(`inflight.config`) stays SkyRL-compatible; `split_job_config` takes it out of a YAML mapping and
out of the command-line overrides before the rest goes to `config_from_dict`.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from inflight.config import ConfigError, Violation
from inflight.config.keys import coerce, is_instance, schema_keys, suggest, type_name
from inflight.config.loader import flatten, parse_value

SECTION = "job"


@dataclass
class JobConfig:
    """Run settings outside the shared schema (YAML section `job:`, overrides `job.<key>=...`)."""

    task: str = "addition"
    """`addition` (built-in, default), `chain_addition` (multi-turn variant), `count_up` (built-in,
    long-tailed answer lengths; needs `inflight.train.defaults.task_overrides`) or `jsonl` (your data;
    the older spelling of `data.train_data`, which selects the data task by itself)."""
    train_data: str | None = None
    """One data file for `task: jsonl` (older spelling of `data.train_data`; every format it reads)."""
    eval_data: str | None = None
    """Held-out file for `task: jsonl` (older spelling of `data.val_data`; default: a seeded split)."""
    num_train: int = 20_000
    """Training problems generated for the built-in tasks."""
    num_eval: int = 200
    """Held-out problems the built-in tasks generate, and the most rows split off your training data
    when `data.val_data` is empty (every row of `data.val_data` is evaluated)."""
    max_steps: int | None = 200
    """Stop after this many training steps (none: run the epochs out)."""
    max_train_seconds: float | None = None
    """Stop training after this many seconds of RL (checked after each step)."""
    eval_interval: int | None = None
    """Old spelling of `trainer.eval_interval` (SkyRL's key, which it sets); give one of the two."""
    output_dir: str = "runs/inflight"
    """metrics.jsonl, TensorBoard events, the plot, and the built base model go here."""
    base_model_dir: str | None = None
    """Where the built-in base model is built and warmed up (default: <output_dir>/base_model)."""
    warmup_steps: int = 400
    """Supervised warm-up steps of the built-in base model (only when no model path is given)."""
    warmup_batch_size: int = 128
    warmup_lr: float = 1e-3
    warmup_max_seconds: float | None = 90.0
    """Stop the warm-up after this long, to leave room for RL."""
    warmup_target_accuracy: float | None = 0.3
    """Stop the warm-up once the held-out greedy accuracy reaches this."""
    warmup_threads: int = 0
    """torch threads during the warm-up; 0 (default) measures 2 against 1 on the first steps and
    keeps the faster (2 wins on an idle 2-core machine, 1 when something else is busy)."""
    threads: int = 1
    """torch threads of the trainer during RL (the engine has its own; see engine_threads)."""
    engine_threads: int = 1
    """torch threads of the engine process."""
    trainer_device: str = "cpu"
    """Torch device of the policy worker (`cpu`, `cuda`, `cuda:N`)."""
    worker: str = "auto"
    """Policy worker: `auto` (megatron for strategy megatron; FSDP when torch.distributed is
    initialised, else the single-process `local` worker), `local`, `fsdp` or `megatron`."""
    tis: str | None = None
    """Old spelling of `trainer.algorithm.off_policy_correction.tis_ratio_type` (`token`, `sequence`,
    `none`), which it sets."""
    tis_cap: float | None = None
    """Old spelling of the truncation cap of the importance weights: sets both
    `trainer.algorithm.off_policy_correction.token_tis_ratio_clip_high` and `sequence_tis_ratio_clip_high`."""
    drop_zero_advantage_groups: bool | None = None
    """Old spelling of `trainer.algorithm.zero_variance_filter`, which it sets."""
    dynamic_sampling: bool = False
    """Fully async: reject such groups at generation instead, and generate others in their place."""
    tensorboard: bool = True
    plot: bool = True
    progress: bool = True
    log_interval: int = 10
    """Print a line every this many steps when the console is not a terminal."""
    ray: bool = False
    """Run the engine and the policy as Ray actors (`inflight.cluster`); needs `ray` installed."""
    ray_address: str | None = None
    """An existing Ray cluster to join (implies `ray`); none starts a local Ray instance."""
    resume: bool = True
    """Resume from the latest checkpoint in trainer.ckpt_path when there is one."""
    max_ckpts_to_keep: int = 2

    def validate(self) -> list[Violation]:
        problems = []
        choices = {"task": ("addition", "chain_addition", "count_up", "jsonl"),
                   "worker": ("auto", "local", "fsdp", "megatron"), "tis": ("none", "token", "sequence")}
        for key, allowed in choices.items():
            if getattr(self, key) not in (*allowed, *([None] if key == "tis" else [])):
                problems.append(Violation(f"{SECTION}.{key}", getattr(self, key), "is not a known choice",
                                          f"use one of {', '.join(allowed)}"))
        if self.task == "jsonl" and not self.train_data:
            problems.append(Violation(f"{SECTION}.train_data", None, "is required for task jsonl",
                                      "give a JSONL file of prompt/answer lines"))
        if self.warmup_threads < 0:
            problems.append(Violation(f"{SECTION}.warmup_threads", self.warmup_threads, "must be >= 0",
                                      "0 picks by measuring"))
        for key in ("num_train", "num_eval", "warmup_batch_size", "threads", "engine_threads", "log_interval",
                    "max_ckpts_to_keep"):
            if getattr(self, key) < 1:
                problems.append(Violation(f"{SECTION}.{key}", getattr(self, key), "must be >= 1", "raise it"))
        if self.max_steps is not None and self.max_steps < 1:
            problems.append(Violation(f"{SECTION}.max_steps", self.max_steps, "must be >= 1 or null", "raise it"))
        if self.tis_cap is not None and self.tis_cap <= 0:
            problems.append(Violation(f"{SECTION}.tis_cap", self.tis_cap, "must be > 0", "e.g. 2.0"))
        return problems


def split_job_config(data: Mapping[str, Any], overrides: Sequence[str]) -> tuple[JobConfig, dict[str, Any], list[str]]:
    """Take the `job` section out of a config mapping and `job.*` out of the overrides; returns
    (JobConfig, the rest of the mapping, the rest of the overrides). Raises ConfigError listing
    unknown job keys, type errors and bad values."""
    rest = dict(data)
    values: dict[str, Any] = {}
    section = rest.pop(SECTION, None) or {}
    for key in [k for k in rest if isinstance(k, str) and k.startswith(SECTION + ".")]:
        values[key[len(SECTION) + 1:]] = rest.pop(key)
    if not isinstance(section, Mapping):
        raise ConfigError([Violation(SECTION, section, "must be a mapping", "write job: {key: value}")])
    values = {**section, **values}
    other = []
    for text in overrides:
        body = text.strip().lstrip("+")
        if body.startswith(SECTION + "."):
            key, _, raw = body.partition("=")
            values[key.strip()[len(SECTION) + 1:]] = parse_value(raw)
        else:
            other.append(text)
    hints = typing.get_type_hints(JobConfig)
    fields = {f.name: hints[f.name] for f in dataclasses.fields(JobConfig)}
    problems: list[Violation] = []
    kwargs = {}
    for key, value in values.items():
        if key not in fields:
            hint = suggest(key, list(fields))
            problems.append(Violation(f"{SECTION}.{key}", value, "unknown key",
                                      f"did you mean '{SECTION}.{hint}'?" if hint else "see inflight/train/job_config.py"))
            continue
        value = coerce(value, fields[key])
        if not is_instance(value, fields[key]):
            problems.append(Violation(f"{SECTION}.{key}", value, f"must be {type_name(fields[key])}", "fix the type"))
            continue
        kwargs[key] = value
    job = JobConfig(**kwargs)
    problems += job.validate() if not problems else []
    if problems:
        raise ConfigError(problems)
    return job, rest, _forward_aliases(values, rest, other, overrides)


_OPC = "trainer.algorithm.off_policy_correction."
ALIASES: dict[str, tuple[str, ...]] = {
    "eval_interval": ("trainer.eval_interval",),
    "tis": (_OPC + "tis_ratio_type",),
    "tis_cap": (_OPC + "token_tis_ratio_clip_high", _OPC + "sequence_tis_ratio_clip_high"),
    "drop_zero_advantage_groups": ("trainer.algorithm.zero_variance_filter",),
}
"""`job.<key>` spellings kept for old configs -> the schema keys they set."""


def _forward_aliases(values: Mapping[str, Any], rest: Mapping[str, Any], overrides: list[str],
                     given: Sequence[str]) -> list[str]:
    """Turn each `job.<alias>` given in `values` (as written: `none` stays a value) into overrides of
    its schema keys, placed first so that a command-line override of a schema key still wins over an
    alias in the file. Both spellings with different values in the same place (file or command
    line) is a ConfigError."""
    leaves, _ = schema_keys()
    forwarded, problems = [], []
    for name, keys in ALIASES.items():
        value = values.get(name)
        if value is None:
            continue
        alias_on_line = _on_line(given, f"{SECTION}.{name}") is not None
        for key in keys:
            other = _on_line(overrides, key) if alias_on_line else flatten(rest).get(key)
            if other is not None and coerce(other, leaves[key]) != coerce(value, leaves[key]):
                rule = f"is the old spelling of {key}, which is also set (to {other!r})"
                problems.append(Violation(f"{SECTION}.{name}", value, rule, f"drop {SECTION}.{name} and keep {key}"))
            forwarded.append(f"{key}={value}")
    if problems:
        raise ConfigError(problems)
    return forwarded + list(overrides)


def _on_line(overrides: Sequence[str], key: str) -> Any:
    """The value the last of `overrides` that sets `key` gives it, else None."""
    value = None
    for text in overrides:
        name, _, raw = text.strip().lstrip("+").partition("=")
        if name.strip() == key:
            value = parse_value(raw)
    return value
