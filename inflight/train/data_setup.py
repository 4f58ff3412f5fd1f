"""`inflight train` on your own data: when the data task is chosen and how it is built.

A run trains on `data.train_data` (SkyRL's key; the older `job.task=jsonl` with `job.train_data` /
`job.eval_data` too) unless `job.task` names a built-in task (the demo's `addition`, ...), which
makes its own problems and scores itself.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from inflight.config import Config, ConfigError, Violation
from inflight.config.job import JobConfig
from inflight.config.keys import default_config, get_key

BUILTIN_TASKS = ("addition", "chain_addition", "count_up")
CHAT_KEYS = ("generator.chat_template.name_or_path", "generator.chat_template_kwargs")
"""Keys of the chat template your data's prompts go through (the built-in tasks render none)."""


def uses_data(cfg: Config, job: JobConfig) -> bool:
    """Whether the run trains on data files: unless `job.task` names a built-in task."""
    return job.task not in BUILTIN_TASKS


def _set(cfg: Config, key: str) -> bool:
    """Whether `key` differs from SkyRL's default in `cfg`."""
    return get_key(cfg, key) != get_key(default_config(), key)


def check_data_job(cfg: Config, job: JobConfig) -> None:
    """Raise ConfigError listing contradictions between the data keys and the job's task."""
    problems = []
    if cfg.data.train_data and _set(cfg, "data.train_data") and job.train_data:
        problems.append(
            Violation(
                "job.train_data",
                job.train_data,
                "is the old spelling of data.train_data, which is also set",
                "keep data.train_data (a list of files) only",
            )
        )
    if cfg.data.val_data and _set(cfg, "data.val_data") and job.eval_data:
        problems.append(
            Violation(
                "job.eval_data",
                job.eval_data,
                "is the old spelling of data.val_data, which is also set",
                "keep data.val_data only",
            )
        )
    if not uses_data(cfg, job):
        for key in ("data.train_data", "data.val_data", "environment.env_class", *CHAT_KEYS):
            if _set(cfg, key) and get_key(cfg, key) != []:  # [] (no files) is no data
                problems.append(
                    Violation(
                        key,
                        get_key(cfg, key),
                        f"is for your data, but the run trains on the built-in task {job.task!r} (job.task)",
                        f"drop job.task to train on your data, or drop {key}",
                    )
                )
    if uses_data(cfg, job) and cfg.trainer.policy.model.path is None:
        problems.append(Violation("trainer.policy.model.path", None, "is required to train on your data",
                                  "set trainer.policy.model.path to a local Hugging Face model directory"))
    if problems:
        raise ConfigError(problems)


def model_context(cfg: Config) -> int | None:
    """Tokens the engine's context holds: `max_model_len` within the model's `max_position_embeddings`."""
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(cfg.trainer.policy.model.path)
    positions = getattr(hf, "max_position_embeddings", None)
    limit = cfg.generator.inference_engine.max_model_len
    return min((x for x in (positions, limit) if x is not None), default=None)


def make_data_task(cfg: Config, job: JobConfig):
    """The `DataTask` of `data.*` (or the old `job.train_data` / `job.eval_data`), with the model's
    tokenizer and context, for a job `check_data_job` passed (`inflight.train.main.make_task`).
    Raises DatasetError / RewardError before any training."""
    from transformers import AutoTokenizer

    from inflight.tasks.data_task import DataTask
    from inflight.tasks.openenv_env import OpenEnvSettings
    from inflight.tasks.skyrl_gym_env import GymSettings
    from inflight.train.vision import check_image_rows, data_vision

    tokenizer = AutoTokenizer.from_pretrained(cfg.trainer.policy.model.path,
                                              use_fast=not cfg.trainer.disable_fast_tokenizer)
    data = cfg.data
    old_spelling = job.task == "jsonl" and bool(job.train_data)  # job.train_data / job.eval_data
    train = [job.train_data] if old_spelling else data.train_data
    val = ([job.eval_data] if job.eval_data else []) if old_spelling else data.val_data
    try:
        vision = data_vision(cfg)  # a vision-language policy's processor: rows may hold images
    except ValueError as err:
        raise ConfigError(
            [
                Violation(
                    "trainer.policy.model.path",
                    cfg.trainer.policy.model.path,
                    str(err),
                    "give a model directory whose processor transformers can load",
                )
            ]
        ) from err
    task = DataTask(
        tokenizer,
        train,
        val,
        prompt_key=data.prompt_key,
        answer_key=data.answer_key,
        chat_format=chat_format(cfg),
        skyrl_gym=GymSettings(cfg.environment.skyrl_gym, cfg.generator.max_turns),
        openenv=OpenEnvSettings.from_config(cfg.environment.openenv),
        agent=cfg.generator.agent.path,
        env_class=cfg.environment.env_class,
        max_prompt_length=cfg.trainer.max_prompt_length,
        drop_long_prompts=data.drop_long_prompts,
        max_new_tokens=cfg.generator.sampling_params.max_generate_length,
        max_context=model_context(cfg),
        num_eval=job.num_eval,
        val_fraction=data.val_fraction,
        seed=cfg.trainer.seed,
        vision=vision,
    )
    check_image_rows(cfg, [*task.train_problems(), *task.eval_problems()])
    return task


def chat_format(cfg: Config):
    """The `ChatFormat` of `generator.chat_template` (a file, or one of SkyRL's names) and
    `generator.chat_template_kwargs`. Raises ChatTemplateError naming the key."""
    from inflight.chat.templates import resolve_chat_template
    from inflight.chat.turns import ChatFormat

    template = cfg.generator.chat_template
    return ChatFormat(resolve_chat_template(template.source, template.name_or_path),
                      dict(cfg.generator.chat_template_kwargs))


class NothingGeneratedError(RuntimeError):
    """A training step whose responses hold no generated token: the run is misconfigured."""


def check_generated(groups: Any, cfg: Config) -> None:
    """Raise NothingGeneratedError when the trajectories of `groups` hold zero generated tokens in
    total, naming the lengths that are the likely cause."""
    trajectories = [t for g in groups for t in g.trajectories]
    if not trajectories or sum(t.num_sampled for t in trajectories) > 0:  # overlong filtering masks some
        return
    reasons = Counter(t.finish_reason for t in trajectories)
    longest = max(len(t.prompt_ids) for t in trajectories)
    ie, sampling = cfg.generator.inference_engine, cfg.generator.sampling_params
    raise NothingGeneratedError(
        f"a training step's {len(trajectories)} responses hold no generated token (finish reasons: "
        f"{', '.join(f'{k} x{v}' for k, v in reasons.items())}); its prompts have up to {longest} tokens, "
        f"generator.sampling_params.max_generate_length={sampling.max_generate_length}, "
        f"generator.inference_engine.max_model_len={ie.max_model_len} (null: the model's context). "
        "The prompt likely fills the context: raise generator.inference_engine.max_model_len (within the "
        "model's max_position_embeddings) or lower trainer.max_prompt_length"
    )
