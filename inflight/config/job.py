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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from inflight.config import ConfigError, Violation
from inflight.config.keys import coerce, is_instance, schema_keys, suggest, type_name
from inflight.config.loader import flatten, parse_value

SECTION = "job"


@dataclass
class JobConfig:
    """Run settings outside the shared schema (YAML section `job:`, overrides `job.<key>=...`)."""

    task: str | None = None
    """A built-in task instead of your data: `addition` (the demo's), `chain_addition` (multi-turn
    variant), `count_up` (long-tailed answer lengths; needs `inflight.train.defaults.task_overrides`);
    or `jsonl` (the older spelling of `data.train_data`). None (default): your data
    (`data.train_data`)."""
    train_data: str | None = None
    """One data file for `task: jsonl` (older spelling of `data.train_data`; every format it reads)."""
    eval_data: str | None = None
    """Held-out file for `task: jsonl` (older spelling of `data.val_data`; default: a seeded split)."""
    num_train: int = 20_000
    """Training problems generated for the built-in tasks."""
    num_eval: int = 200
    """Held-out problems the built-in tasks generate, and the most rows split off your training data
    when `data.val_data` is empty (every row of `data.val_data` is evaluated)."""
    max_train_seconds: float | None = None
    """A cap on the seconds of RL (checked after each step), for a machine too slow for the run's
    steps (`trainer.max_training_steps`, the epochs), which are its budget; the run says when the cap
    ended RL before them."""
    eval_interval: int | None = None
    """Old spelling of `trainer.eval_interval` (SkyRL's key, which it sets); give one of the two."""
    output_dir: str = "runs/inflight"
    """metrics.jsonl, TensorBoard events, the plot, and the built base model go here."""
    base_model_dir: str | None = None
    """Where the built-in base model is built and warmed up (default: <output_dir>/base_model)."""
    arch: str = "qwen2"
    """Architecture of the built-in base model (when no model path is given): `qwen2` (default,
    dense), `qwen3_moe` or `qwen2_moe` (a mixture of experts of the same shape: 8 experts, 2 per
    token; `inflight.tasks.base_model.ARCHS`), e.g. to train with routing replay."""
    warmup_steps: int = 300
    """Supervised warm-up steps of the built-in base model (only when no model path is given): the
    warm-up's budget, so that every machine starts RL from the same model."""
    warmup_batch_size: int = 128
    """Problems per supervised warm-up step of the built-in base model."""
    warmup_lr: float = 1e-3
    """Learning rate of the supervised warm-up of the built-in base model."""
    warmup_max_seconds: float | None = 1200.0
    """A cap on the warm-up's seconds, for a machine too slow for its steps; the run says when it
    ended the warm-up before them (null: no cap)."""
    warmup_target_accuracy: float | None = None
    """Stop the warm-up early once the held-out teacher-forced accuracy reaches this (checked every
    25 steps; null: run every step)."""
    warmup_threads: int = 0
    """torch threads during the warm-up; 0 (default) measures 2 against 1 on the first steps and
    keeps the faster (2 wins on an idle 2-core machine, 1 when something else is busy)."""
    threads: int = 1
    """torch threads of the trainer during RL (the engine has its own; see engine_threads)."""
    engine_threads: int = 1
    """torch threads of the engine process."""
    lend_threads: bool | None = None
    """The side that computes alone takes the other's threads (`inflight.orchestration.thread_lending`): the
    synchronous trainer's engines generate with job.engine_threads + job.threads (shared among them)
    and its steps train with job.threads + the engines' job.engine_threads; the fully-async trainer's
    steps take the engines' threads while generation is ahead (bounded staleness reached, nothing
    generating) and give them back when a group may start, and its engines take job.threads (shared
    among them) while the trainer waits for groups, giving them back at their next step once a
    training step starts (metrics `threads/engine_lent_fraction`). Engines in this run's processes only (not
    HTTP servers or Ray actors, whose CPUs are fixed at launch: refused there). null (default): on
    for a policy of at least 10M parameters (`thread_lending.LEND_MIN_PARAMETERS`) whose engines run
    in this run's processes, off otherwise: on the demo's 0.8M model a second OpenMP thread slows
    both phases; on a 41M one it gives the synchronous trainer 1.6x and the fully-async one 1.26x the
    samples/s (docs/benchmarks.md)."""
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
    tensorboard: bool = True
    """Write TensorBoard events when trainer.logger names tensorboard (false turns them off whatever
    trainer.logger says, e.g. in tests)."""
    plot: bool = True
    """Draw the reward / staleness plot (`<output_dir>/reward_staleness.png`) after the run."""
    progress: bool = True
    """Show the progress bar when trainer.logger names console (false: a line every log_interval steps)."""
    log_interval: int = 10
    """Print a line every this many steps when the console is not a terminal."""
    ray: bool = False
    """Run the engine and the policy as Ray actors (`inflight.cluster`); needs `ray` installed."""
    ray_address: str | None = None
    """An existing Ray cluster to join (implies `ray`); none starts a local Ray instance."""

    def validate(self) -> list[Violation]:
        problems = []
        choices = {"task": (None, "addition", "chain_addition", "count_up", "jsonl"),
                   "arch": ("qwen2", "qwen3_moe", "qwen2_moe"),
                   "worker": ("auto", "local", "fsdp", "megatron"), "tis": ("none", "token", "sequence")}
        for key, allowed in choices.items():
            if getattr(self, key) not in (*allowed, *([None] if key == "tis" else [])):
                problems.append(Violation(f"{SECTION}.{key}", getattr(self, key), "is not a known choice",
                                          f"use one of {', '.join(str(a) for a in allowed if a)}"))
        if self.task == "jsonl" and not self.train_data:
            problems.append(Violation(f"{SECTION}.train_data", None, "is required for task jsonl",
                                      "give a JSONL file of prompt/answer lines"))
        if self.warmup_threads < 0:
            problems.append(Violation(f"{SECTION}.warmup_threads", self.warmup_threads, "must be >= 0",
                                      "0 picks by measuring"))
        for key in (
            "num_train", "num_eval", "warmup_batch_size", "threads", "engine_threads", "log_interval",
        ):
            if getattr(self, key) < 1:
                problems.append(Violation(f"{SECTION}.{key}", getattr(self, key), "must be >= 1", "raise it"))
        if self.lend_threads and (self.ray or self.ray_address):
            problems.append(
                Violation(
                    f"{SECTION}.lend_threads",
                    True,
                    "cannot lend the threads of Ray actors, whose CPUs are fixed at launch",
                    "set job.lend_threads=false with --ray",
                )
            )
        if self.tis_cap is not None and self.tis_cap <= 0:
            problems.append(Violation(f"{SECTION}.tis_cap", self.tis_cap, "must be > 0", "e.g. 2.0"))
        return problems


def split_job_config(
    data: Mapping[str, Any], overrides: Sequence[str]
) -> tuple[JobConfig, dict[str, Any], list[str]]:
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
    other: list[str] = []
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
        if key in ALIASES and key not in fields:
            continue  # forwarded to its schema keys below
        if key not in fields:
            hint = suggest(key, [*fields, *ALIASES])
            problems.append(
                Violation(
                    f"{SECTION}.{key}",
                    value,
                    "unknown key",
                    f"did you mean '{SECTION}.{hint}'?" if hint else "see inflight/config/job.py",
                )
            )
            continue
        value = coerce(value, fields[key])
        if not is_instance(value, fields[key]):
            problems.append(
                Violation(f"{SECTION}.{key}", value, f"must be {type_name(fields[key])}", "fix the type")
            )
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
    "max_steps": ("trainer.max_training_steps",),
    "max_ckpts_to_keep": ("trainer.max_ckpts_to_keep",),
    "resume": ("trainer.resume_mode",),
    "dynamic_sampling": ("trainer.fully_async.sample_full_batch",),
}
"""`job.<key>` spellings kept for old configs -> the schema keys they set."""
ALIAS_VALUES: dict[str, Callable[[Any], Any]] = {
    "resume": lambda v: "latest" if coerce(v, bool) is True else ("none" if coerce(v, bool) is False else v),
}
"""How an alias's value becomes its keys' (`job.resume=true` is resume_mode `latest`)."""


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
        value = ALIAS_VALUES.get(name, lambda v: v)(value)
        alias_on_line = _on_line(given, f"{SECTION}.{name}") is not None
        for key in keys:
            other = _on_line(overrides, key) if alias_on_line else flatten(rest).get(key)
            if other is not None and coerce(other, leaves[key]) != coerce(value, leaves[key]):
                rule = f"is the old spelling of {key}, which is also set (to {other!r})"
                problems.append(
                    Violation(f"{SECTION}.{name}", value, rule, f"drop {SECTION}.{name} and keep {key}")
                )
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
