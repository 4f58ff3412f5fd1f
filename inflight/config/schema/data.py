"""Your data and how responses to it are scored (SkyRL: `data`, `environment`)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from inflight.config.status import accepted, ours, skyrl

_IN_PROCESS = accepted("prompts are read in the trainer's process: there are no DataLoader workers to start")


@dataclass
class DataLoaderConfig:
    """SkyRL's prompt DataLoader workers."""

    num_workers: int | None = skyrl(None, status=_IN_PROCESS)
    persistent_workers: bool = skyrl(False, status=_IN_PROCESS)


@dataclass
class DataConfig:
    """Your own data (SkyRL: `data`)."""

    train_data: list[str] = skyrl(factory=lambda: [os.path.expanduser("~/data/gsm8k/train.parquet")])
    """Training files: `.parquet`, `.jsonl` / `.json`, or `datasets.save_to_disk` directories; a single
    path is read as a list of one. Default [~/data/gsm8k/train.parquet]."""
    val_data: list[str] = skyrl(factory=lambda: [os.path.expanduser("~/data/gsm8k/validation.parquet")])
    """Held-out files, same formats. Default [~/data/gsm8k/validation.parquet]; []: held-out problems
    are split off the training data (seeded by trainer.seed, data.val_fraction of it, at most
    job.num_eval) and never trained on."""
    dataloader: DataLoaderConfig = field(default_factory=DataLoaderConfig)
    val_fraction: float = ours(0.1)
    """Share of the training rows split off as held-out when val_data is empty, in (0, 1). Default 0.1."""
    prompt_key: str | None = ours(None)
    """Column holding the prompt (text or chat messages); none (default): `prompt`, else `question`."""
    answer_key: str | None = ours(None)
    """Column holding the ground truth; none (default): `reward_spec.ground_truth` (SkyRL's rows), else
    `answer`. An answer with `####` (GSM8K's) has what follows the last `####` as its ground truth."""
    drop_long_prompts: bool = ours(True)
    """Drop prompts longer than trainer.max_prompt_length (counted and reported); false refuses the data
    with an error naming the first such row. Default true."""

    def __post_init__(self) -> None:
        self.train_data = [self.train_data] if isinstance(self.train_data, str) else self.train_data
        self.val_data = [self.val_data] if isinstance(self.val_data, str) else self.val_data


@dataclass
class Text2SQLConfig:
    """skyrl-gym's `text2sql` environment."""

    db_path: str = skyrl("/home/ray/default/sql_data")
    """Directory of the SQLite databases the queries run against (a row's `db_id` and `data` name one,
    under spider/, bird/ or SynSQL-2.5M/); checked for every row when the data is loaded."""


@dataclass
class SearchConfig:
    """skyrl-gym's `search` environment (Search-R1)."""

    log_requests: bool = skyrl(False)
    """Log every retrieval request. Default false."""
    search_url: str = skyrl("http://127.0.0.1:8000/retrieve")
    """The retriever service's URL, probed once when the data is loaded. Default
    http://127.0.0.1:8000/retrieve."""
    topk: int = skyrl(3)
    """Documents per query. Default 3."""
    timeout: int = skyrl(30)
    """Seconds a retrieval may take. Default 30."""


@dataclass
class LLMJudgeConfig:
    """The `llm_as_a_judge` environment of SkyRL's examples (an OpenAI-compatible judge): the
    `env_config` of the environment registered in skyrl-gym under that id (ours,
    `inflight.tasks.skyrl_examples`, unless your code registers another)."""

    model: str = skyrl("gpt-4o-mini")
    """The judge's model name. Default gpt-4o-mini."""
    base_url: str | None = skyrl(None)
    """The judge's OpenAI-compatible base URL (probed when the data is loaded); null (default): OpenAI's."""


@dataclass
class SkyRLGymConfig:
    """Settings of the skyrl-gym environments (SkyRL: `environment.skyrl_gym`)."""

    max_env_workers: int = skyrl(32)
    """skyrl-gym environment calls (init, step, close) that run at once, each in a thread, >= 1.
    Default 32."""
    text2sql: Text2SQLConfig = field(default_factory=Text2SQLConfig)
    llm_as_a_judge: LLMJudgeConfig = field(default_factory=LLMJudgeConfig)
    search: SearchConfig = field(default_factory=SearchConfig)


@dataclass
class OpenEnvConfig:
    """`environment.env_class=openenv`: an OpenEnv environment server plays the episodes (not a SkyRL key:
    SkyRL's OpenEnv example hard-codes its environments; `inflight.tasks.openenv_env`)."""

    url: str | None = ours(None)
    """A running OpenEnv server (`http://host:port`); each episode opens its own session. null (default):
    `image`, else each row's `env_name` column as the image `<env_name>:latest` (SkyRL's rows)."""
    image: str | None = ours(None)
    """A Docker image of an OpenEnv server: each episode starts its own container (openenv-core's
    LocalDockerProvider). null (default): `url`."""
    action_field: str | None = ours(None)
    """The action field that takes the model's text (the last `<action>...</action>` of a response, else
    the whole response). null (default): the one required text field of the server's action schema."""


@dataclass
class EnvironmentConfig:
    """How responses to your data are scored (SkyRL: `environment`)."""

    env_class: str = skyrl("gsm8k")
    """The reward / environment of rows without their own `env_class` column (a row's own wins):
    `gsm8k` (default), `gsm8k_flexible`, `math`, `exact`, `contains`, `regex`, a skyrl-gym
    environment (`aime`, `gsm8k_multi_turn`, `lcb`, `search`, `text2sql`, ...; also
    `skyrl_gym:<id>`), `openenv` (an OpenEnv server, environment.openenv), `verifiers:<env id>` (an
    installed verifiers environment, played through the agent endpoint in verifiers' own venv; its
    rubric is the reward), a name given to `inflight.rewards.register`, or `package.module:name`
    (your reward function or environment class). Built-in tasks (job.task) score themselves and
    refuse this key."""
    skyrl_gym: SkyRLGymConfig = field(default_factory=SkyRLGymConfig)
    openenv: OpenEnvConfig = field(default_factory=OpenEnvConfig)
    verifiers: dict[str, Any] = ours(factory=dict)
    """env_class=verifiers:<env id> only: the keyword arguments of the environment's
    `load_environment` (e.g. `environment.verifiers.num_train_examples=100`). Default {}."""
    reward_timeout_s: float | None = ours(60.0)
    """Most seconds one reward / environment step may take; a step that takes longer, or raises,
    scores its sample 0 and is counted (`reward/failures`), and training goes on. None: no limit.
    Default 60."""
