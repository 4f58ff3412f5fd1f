"""`inflight train` on your own data: when the data task is chosen, what lengths it gets, how it is built.

`data.train_data` (SkyRL's key) selects the data task, and so does the older `job.task=jsonl` with
`job.train_data` / `job.eval_data`. Lengths come from the model and the data: the default job's
settings sized for the toy addition task (a 64-token context, 8 generated tokens, a 50 MiB KV cache)
are left out when the default job runs on user data, so the schema's defaults apply (the model's
context, `generator.sampling_params.max_generate_length` 1024, 1 GiB of KV); anything the user sets
still wins.
"""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Mapping
from typing import Any

from inflight.config import Config, ConfigError, Violation
from inflight.train.job_config import JobConfig

TOY_LENGTH_KEYS = (("generator", "inference_engine", "max_model_len"),
                   ("generator", "inference_engine", "kv_cache_memory_gib"),
                   ("generator", "sampling_params", "max_generate_length"))
"""Settings of the default job that only fit the addition task."""


def uses_data(cfg: Config, job: JobConfig) -> bool:
    """Whether the run trains on data files (`data.train_data`, or `job.task=jsonl`)."""
    return bool(cfg.data.train_data) or job.task == "jsonl"


def without_toy_lengths(data: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of the default job's mapping without `TOY_LENGTH_KEYS`."""
    out = copy.deepcopy(dict(data))
    for *parents, leaf in TOY_LENGTH_KEYS:
        node = out
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node.pop(leaf, None)
    return out


def check_data_job(cfg: Config, job: JobConfig) -> None:
    """Raise ConfigError listing contradictions between the data keys and the job's task."""
    problems = []
    if cfg.data.train_data and job.train_data:
        problems.append(Violation("job.train_data", job.train_data, "is the old spelling of data.train_data, which "
                                  "is also set", "keep data.train_data (a list of files) only"))
    if cfg.data.val_data and job.eval_data:
        problems.append(Violation("job.eval_data", job.eval_data, "is the old spelling of data.val_data, which is "
                                  "also set", "keep data.val_data only"))
    if cfg.data.train_data and job.task not in ("addition", "jsonl"):
        problems.append(Violation("job.task", job.task, "is a built-in task, but data.train_data is set",
                                  "drop job.task to train on your data, or drop data.train_data"))
    if not uses_data(cfg, job) and cfg.environment.env_class is not None:
        problems.append(Violation("environment.env_class", cfg.environment.env_class,
                                  f"scores your data, but the run trains on the built-in task {job.task!r}",
                                  "give data.train_data, or drop environment.env_class"))
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

    tokenizer = AutoTokenizer.from_pretrained(cfg.trainer.policy.model.path)
    data = cfg.data
    train = data.train_data or [job.train_data]
    val = data.val_data or ([job.eval_data] if job.eval_data else [])
    return DataTask(
        tokenizer, train, val, prompt_key=data.prompt_key, answer_key=data.answer_key,
        env_class=cfg.environment.env_class, max_prompt_length=cfg.trainer.max_prompt_length,
        drop_long_prompts=data.drop_long_prompts, max_new_tokens=cfg.generator.sampling_params.max_generate_length,
        max_context=model_context(cfg), num_eval=job.num_eval, val_fraction=data.val_fraction, seed=cfg.trainer.seed,
    )


class NothingGeneratedError(RuntimeError):
    """A training step whose responses hold no generated token: the run is misconfigured."""


def check_generated(groups: Any, cfg: Config) -> None:
    """Raise NothingGeneratedError when the trajectories of `groups` hold zero generated tokens in
    total, naming the lengths that are the likely cause."""
    trajectories = [t for g in groups for t in g.trajectories]
    if not trajectories or sum(t.num_generated for t in trajectories) > 0:
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
