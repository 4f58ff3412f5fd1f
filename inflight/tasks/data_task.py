"""`DataTask`: training on your own data files (`data.train_data`, `data.val_data`), scored by the
reward or environment each row names (`env_class`, else `environment.env_class`).

At construction, before any training: every file is read (`load_problems`), every reward name is
resolved (a `package.module:name` is imported; an error names the module and the key; a skyrl-gym
environment is built for every row of its and the services it needs are checked,
`inflight.tasks.skyrl_gym_env`), prompts longer than `max_prompt_length` tokens (after the chat
template of `chat_format`) are dropped and counted (or refused), and, without held-out files, a
seeded share of the rows is split off as held-out and never trained on. `report` says what
happened; `inflight train` prints it and stores it in summary.json.
"""

from __future__ import annotations

import inspect
import math
import random
from collections.abc import Awaitable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from inflight.chat.images import ImageLimits, count_images
from inflight.chat.turns import PLAIN, ChatFormat
from inflight.chat.vision import Vision
from inflight.import_path import import_object
from inflight.rewards import RewardError
from inflight.rewards.gsm8k import gsm8k_flexible_reward, gsm8k_ground_truth, gsm8k_reward
from inflight.rewards.hubs import agent_hub, find_hub
from inflight.rewards.numbers import to_number
from inflight.rewards.registry import CONFIG_KEY
from inflight.tasks.base import Environment, Problem, SingleTurnEnv, Task
from inflight.tasks.dataset import DatasetError, encode_chat_prompt, load_problems
from inflight.tasks.openenv_env import OpenEnvSettings
from inflight.tasks.skyrl_gym_env import GymEnvironmentMaker, GymSettings

AUTO_GSM8K, AUTO_OTHER = "gsm8k", "exact"
"""What rows without an `env_class` are scored by when no `env_class` is given (the Python API's
default; `inflight train` and `inflight eval` give `environment.env_class`, SkyRL's `gsm8k`): GSM8K's
rule for answers that held `####`, exact match otherwise."""


def reward_name(problem: Problem, env_class: str | None = None) -> str:
    """The reward / environment name that scores `problem`, in training and in `inflight eval`: the
    row's own `env_class`, else `env_class` (`environment.env_class`), else `gsm8k` for GSM8K-style
    answers and `exact` otherwise."""
    own = problem.meta.get("env_class")
    if own:
        return str(own)
    if env_class:
        return env_class
    return AUTO_GSM8K if problem.meta.get("gsm8k_format") else AUTO_OTHER


def reward_extra(problem: Problem) -> dict[str, Any]:
    """The keyword arguments a reward gets for `problem`: the row's `extra_info`."""
    extra = dict(problem.meta.get("extra_info") or {})
    extra.pop("response", None)
    extra.pop("ground_truth", None)
    return extra


@dataclass
class DataReport:
    """What became of the data: rows per split, where the held-out rows came from, dropped prompts."""

    train_files: list[str]
    val_files: list[str]
    train_rows: int = 0
    val_rows: int = 0
    val_source: str = "data.val_data"
    """`data.val_data`, or `split` (split off the training rows, seeded; never trained on)."""
    max_prompt_length: int = 0
    """The prompt limit applied: trainer.max_prompt_length, or less when the model's context is shorter."""
    dropped_long_prompts: dict[str, int] = field(default_factory=dict)
    longest_prompt: int = 0
    """Longest prompt kept, in tokens."""
    rewards: dict[str, int] = field(default_factory=dict)
    """Rows per reward / environment name."""
    refused_image_rows: list[str] = field(default_factory=list)
    """Rows left out for a bad image (unreadable, over the limits, missing file): each one's reason."""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def summary(self) -> str:
        dropped = sum(self.dropped_long_prompts.values())
        held = (
            "from data.val_data"
            if self.val_source == "data.val_data"
            else "split off the training data (seeded, never trained on)"
        )
        text = (
            f"data: {self.train_rows} training problems, {self.val_rows} held-out {held}; "
            f"rewards: {', '.join(f'{k} x{v}' for k, v in self.rewards.items())}"
        )
        if self.refused_image_rows:
            text += (f"; refused {len(self.refused_image_rows)} rows with a bad image "
                     f"(first: {self.refused_image_rows[0]})")
        if dropped:
            text += (
                f"; dropped {dropped} prompts longer than {self.max_prompt_length} tokens "
                f"({', '.join(f'{k}: {v}' for k, v in self.dropped_long_prompts.items())})"
            )
        return text


class DataTask(Task):
    """Problems from data files, scored by the rewards their rows name.

    `max_prompt_length`: longest prompt kept, in tokens after the chat template (`max_context`, the
    model's context, lowers it to leave at least one token to generate); `drop_long_prompts=False`
    refuses longer ones instead. `num_eval` / `val_fraction`: without `val_data`, `min(num_eval,
    ceil(val_fraction * rows))` rows (at least 1, seeded by `seed`) are held out. `chat_format`:
    the chat template and its arguments (`generator.chat_template`, `chat_template_kwargs`);
    `skyrl_gym`: what skyrl-gym's environments get (`environment.skyrl_gym`, `generator.max_turns`).
    `agent`: the agent that plays and scores the rows' episodes (`generator.agent.path`): then no
    reward is resolved and the report names the agent. `vision`: a vision-language model's processor
    and image limits; rows holding images need it (`encode_prompt` expands their placeholders,
    `dataset.image_prompt` gives the image tensors too); a row with a bad image is left out and
    counted (`report.refused_image_rows`).
    """

    name = "data"

    def __init__(
        self,
        tokenizer: Any,
        train_data: Sequence[str | Path],
        val_data: Sequence[str | Path] = (),
        *,
        prompt_key: str | None = None,
        answer_key: str | None = None,
        env_class: str | None = None,
        max_prompt_length: int = 512,
        drop_long_prompts: bool = True,
        max_new_tokens: int = 1024,
        max_context: int | None = None,
        num_eval: int = 200,
        val_fraction: float = 0.1,
        seed: int = 42,
        chat_template: bool = True,
        chat_format: ChatFormat = PLAIN,
        skyrl_gym: GymSettings | None = None,
        openenv: OpenEnvSettings | None = None,
        agent: str | None = None,
        vision: Vision | None = None,
    ) -> None:
        super().__init__(tokenizer)
        self.vision = vision
        if not train_data:
            raise DatasetError("no training data: set data.train_data to a list of files")
        self.env_class = env_class
        self.agent = agent
        self.max_new_tokens = max_new_tokens
        self.chat_format = chat_format
        self.skyrl_gym = skyrl_gym if skyrl_gym is not None else GymSettings()
        self.openenv = openenv if openenv is not None else OpenEnvSettings()
        self.chat_template = chat_template and chat_format.has_template(tokenizer)
        if chat_format.kwargs and not self.chat_template:
            raise DatasetError(
                "generator.chat_template_kwargs is set, but no chat template renders the prompts "
                f"({type(tokenizer).__name__} has none): drop it, or give a template "
                "(generator.chat_template)"
            )
        limit = max_prompt_length if max_context is None else min(max_prompt_length, max_context - 1)
        self.report = DataReport(
            [str(p) for p in train_data], [str(p) for p in val_data], max_prompt_length=limit
        )
        limits = vision.limits if vision is not None else None
        refused = self.report.refused_image_rows
        train = _load_all(train_data, prompt_key, answer_key, limits, refused)
        val = _load_all(val_data, prompt_key, answer_key, limits, refused) if val_data else []
        self._check_images(train + val)
        self._rewards = self._resolve_rewards(train + val)
        train = self._fit(train, "train", limit, drop_long_prompts, max_prompt_length, max_context)
        if val_data:
            val = self._fit(val, "val", limit, drop_long_prompts, max_prompt_length, max_context)
        else:
            train, val = split_held_out(train, num_eval, val_fraction, seed)
            self.report.val_source = "split"
        self._train, self._eval = train, val
        self.report.train_rows, self.report.val_rows = len(train), len(val)

    # ---- start-up -----------------------------------------------------------------------------
    def _check_images(self, problems: list[Problem]) -> None:
        """Rows with images need the model's image processor (`vision`): refused up front without one."""
        if self.vision is not None:
            return
        with_images = [p for p in problems if not isinstance(p.prompt, str) and count_images(p.prompt)]
        if with_images:
            raise DatasetError(
                f"{len(with_images)} rows hold images (e.g. {with_images[0].meta['source']}), but this task "
                "has no image processor: the model is text-only, or the run does not give DataTask the "
                "model's processor (vision=); drop the images or give a vision-language model"
            )

    def _resolve_rewards(self, problems: list[Problem]) -> dict[str, Any]:
        if self.agent is not None:  # the agent plays and scores every episode: no reward of ours runs
            self.report.rewards = {f"your agent ({self.agent})": len(problems)}
            return {}
        resolved: dict[str, Any] = {}
        rows: dict[str, list[Problem]] = {}
        for p in problems:
            name = reward_name(p, self.env_class)
            self.report.rewards[name] = self.report.rewards.get(name, 0) + 1
            rows.setdefault(name, []).append(p)
            if agent_hub(self.env_class) is not None or agent_hub(name) is not None:
                self._check_verifiers_row(p, name)
                continue  # the hub's agent (verifiers') scores it, through the agent endpoint
            if name in resolved:
                continue
            try:
                resolved[name] = self._resolve(name)
            except RewardError as err:
                if p.meta.get("env_class"):
                    raise DatasetError(f"{p.meta['source']}: column 'env_class': {err}") from err
                raise
        for name, fn in resolved.items():
            if isinstance(fn, GymEnvironmentMaker):
                fn.check(rows[name])
            elif fn in (gsm8k_reward, gsm8k_flexible_reward):
                self._check_numbers(name, rows[name])
        return resolved

    def _check_numbers(self, name: str, problems: list[Problem]) -> None:
        """`gsm8k` compares the response's number with the ground truth: a row whose answer is no
        number could never score 1, so it is refused, not trained on at reward 0."""
        rows = {p.meta.get("source", p.id): p for p in problems}  # a file that is both train and val: once
        bad = [p for p in rows.values() if to_number(gsm8k_ground_truth(p.answer)) is None]
        if bad:
            raise DatasetError(
                f"{len(bad)} of {len(rows)} rows are scored by {name} (the row's env_class column, else "
                f"environment.env_class={self.env_class!r}; in inflight eval, --env-class), which compares "
                f"the number in the response with the answer, but their answers are not numbers (e.g. "
                f"{bad[0].meta.get('source')}: {bad[0].answer!r}): they could never score 1. Set "
                "environment.env_class to a reward that fits them, e.g. exact, contains or regex (inflight "
                "eval: --env-class exact), or give those rows an env_class column"
            )

    def _check_verifiers_row(self, problem: Problem, name: str) -> None:
        """A verifiers environment plays every row of its run: a row may name only that one."""
        if name != self.env_class:
            raise DatasetError(
                f"{problem.meta['source']}: column 'env_class' names {name!r}, but a run plays every row "
                f"with one environment, environment.env_class={self.env_class!r}: a verifiers environment "
                "(verifiers:<env id>) must be environment.env_class, and then rows may name no other"
            )

    def _resolve(self, name: str) -> Any:
        """A skyrl-gym environment's maker, an environment class, or a reward function: what the hub
        that holds `name` makes (`inflight.rewards.hubs`)."""
        hub = find_hub(name)
        if hub.make is None:
            raise RewardError(
                f"{CONFIG_KEY}={name!r} is a {hub.name} environment: its agent plays its episodes "
                "through the agent endpoint of `inflight train` (its rubric is the reward), "
                "not as a reward here"
            )
        return import_object(hub.make, CONFIG_KEY, RewardError)(name, self)

    def _fit(
        self,
        problems: list[Problem],
        split: str,
        limit: int,
        drop: bool,
        max_prompt_length: int,
        max_context: int | None,
    ) -> list[Problem]:
        """The problems whose prompt fits `limit` tokens; the others dropped (counted) or refused."""
        kept = []
        for p in problems:
            n = len(self.encode_prompt(p.prompt))
            p.meta["prompt_tokens"] = n
            if n <= limit:
                kept.append(p)
                self.report.longest_prompt = max(self.report.longest_prompt, n)
            elif not drop:
                raise DatasetError(
                    f"{p.meta['source']}: the prompt has {n} tokens, more than "
                    f"{_limit_text(limit, max_prompt_length, max_context)}; raise "
                    "trainer.max_prompt_length, or set data.drop_long_prompts=true to drop such rows"
                )
        self.report.dropped_long_prompts[split] = len(problems) - len(kept)
        if not kept:
            shortest = min(p.meta["prompt_tokens"] for p in problems)
            raise DatasetError(
                f"every {split} prompt is longer than "
                f"{_limit_text(limit, max_prompt_length, max_context)} (the shortest has "
                f"{shortest} tokens): nothing to {'train on' if split == 'train' else 'evaluate'}; "
                "raise trainer.max_prompt_length"
            )
        return kept

    # ---- the Task interface -------------------------------------------------------------------
    def train_problems(self) -> Sequence[Problem]:
        return self._train

    def eval_problems(self) -> Sequence[Problem]:
        return self._eval

    def reward_fn(self, problem: Problem) -> Any:
        """The reward function (or environment class) that scores `problem`."""
        name = reward_name(problem, self.env_class)
        if name not in self._rewards:
            self._rewards[name] = self._resolve(name)
        return self._rewards[name]

    def reward(self, problem: Problem, response: str) -> float | Awaitable[float]:
        """The row's reward of `response`: a float, or an awaitable of one when the reward (or the
        environment class's step) is async; SingleTurnEnv awaits it on the generator's loop, so an
        async reward never blocks that loop (`score` always awaits)."""
        fn = self.reward_fn(problem)
        if _makes_env(fn):  # an environment: its single-turn score
            env = fn(problem)
            opened = env.reset()
            if inspect.isawaitable(opened):
                return _env_score(env, opened, response)
            result = env.step(response)
            if inspect.isawaitable(result):
                return _step_reward(env, result)
            closed = env.close() if callable(getattr(env, "close", None)) else None
            if inspect.isawaitable(closed):  # an async close after a sync step: awaited with the reward
                return _step_reward(env, result, closed)
            return float(result.reward)
        value = fn(response, problem.answer, **reward_extra(problem))
        return _as_float(value) if inspect.isawaitable(value) else float(value)

    async def score(self, problem: Problem, response: str) -> float:
        """`reward`, awaited: what an async caller should use."""
        value = self.reward(problem, response)
        return await value if inspect.isawaitable(value) else value

    def make_env(self, problem: Problem) -> Environment:
        """The row's environment class built for the problem (`cls(problem)`), else single-turn."""
        fn = self.reward_fn(problem)
        return fn(problem) if _makes_env(fn) else SingleTurnEnv(self, problem)

    def encode_prompt(self, prompt: str | list[dict[str, str]]) -> list[int]:
        return encode_chat_prompt(self, prompt, self.chat_template)


def _limit_text(limit: int, max_prompt_length: int, max_context: int | None) -> str:
    if limit < max_prompt_length:
        return f"{limit} tokens (the model's context of {max_context} tokens less one to generate)"
    return f"trainer.max_prompt_length={max_prompt_length} tokens"


def _load_all(paths: Sequence[str | Path], prompt_key: str | None, answer_key: str | None,
              image_limits: ImageLimits | None = None, refused: list[str] | None = None) -> list[Problem]:
    """The problems of several files; ids must be unique across them. Rows with a bad image are left
    out, their reasons appended to `refused`."""
    problems: list[Problem] = []
    seen: dict[str, str] = {}
    for path in paths:
        for p in load_problems(path, prompt_key, answer_key, image_limits=image_limits, refused=refused):
            if p.id in seen:
                raise DatasetError(
                    f"{p.meta['source']}: id {p.id!r} also names {seen[p.id]}: ids must be "
                    "unique across data files (rename one file, or give distinct 'id' values)"
                )
            seen[p.id] = p.meta["source"]
            problems.append(p)
    return problems


def split_held_out(
    problems: Sequence[Problem], num_eval: int, val_fraction: float, seed: int
) -> tuple[list[Problem], list[Problem]]:
    """(train, held-out): `min(num_eval, ceil(val_fraction * len))` problems (at least 1) drawn with
    `random.Random(seed)`, the rest for training in their original order. Needs 2 problems or more."""
    if len(problems) < 2:
        raise DatasetError(
            f"{len(problems)} usable training row(s): too few to split off held-out problems; "
            "give data.val_data, or more data"
        )
    n_val = max(1, min(num_eval, math.ceil(val_fraction * len(problems)), len(problems) - 1))
    held = set(random.Random(seed).sample(range(len(problems)), n_val))
    train = [p for i, p in enumerate(problems) if i not in held]
    return train, [p for i, p in enumerate(problems) if i in held]


async def _as_float(value: Awaitable[Any]) -> float:
    return float(await value)


def _makes_env(fn: Any) -> bool:
    """Whether a resolved name builds environments (a class, a skyrl-gym maker), not a reward."""
    return inspect.isclass(fn) or isinstance(fn, GymEnvironmentMaker)


async def _env_score(env: Any, opened: Awaitable[Any], response: str) -> float:
    """One step's reward of an environment whose `reset` is async."""
    await opened
    return await _step_reward(env, env.step(response))


async def _step_reward(env: Any, result: Any, closed: Any = None) -> float:
    """The reward of one step (awaited), the environment closed after it (`closed`: its close, begun)."""
    try:
        return float((await result if inspect.isawaitable(result) else result).reward)
    finally:
        if closed is None and callable(getattr(env, "close", None)):
            closed = env.close()
        if inspect.isawaitable(closed):
            await closed
