"""skyrl-gym's environments, run unchanged in this project's episodes.

`environment.env_class` (or a row's `env_class`) names one by its skyrl-gym id (`aime`,
`gsm8k_multi_turn`, `lcb`, `search`, `searchcode`, `text2sql`; a name that is also one of ours,
`gsm8k`, stays ours; the ids SkyRL's example entry points register, `multiply` and
`llm_as_a_judge`: `inflight.tasks.skyrl_examples`), as `skyrl_gym:<id>` (any id skyrl-gym's registry holds
when the run starts), or as `package.module:Class` for a `skyrl_gym.Env` subclass of your own. Each episode
builds the environment as SkyRL's generator does: `skyrl_gym.make(id, env_config=..., extras=...)`, where
`env_config` is the run's `environment.skyrl_gym.<id>` section (text2sql's `db_path`, search's `search_url` /
`topk` / `timeout` / `log_requests`, `llm_as_a_judge`'s `model` / `base_url`; none for the others; a class of
your own gets the section of the id it registered itself under, if any) and `extras` is a copy of the row's
columns other than the prompt and `env_class` (`reward_spec`, `extra_info`, `db_id`, ...) with `max_turns` set
to `generator.max_turns`.

The episode is SkyRL's: `init(prompt)` gives the opening messages, every `step(text)` returns the
turn's reward, whether the episode is done, and observation messages, which the chat template
renders between the turns token-in/token-out (`inflight.rollout`); the environment ends the episode
(generator.max_turns reaches it through `extras`), or the input cap does. Every `init`, `step` and
`close` runs in a thread, at most `environment.skyrl_gym.max_env_workers` at once. The text a step
gets keeps the stop string that ended the turn (SkyRL's engines always keep it, and these
environments parse it: `</search>`, `</sql>`). Each turn's reward stays with its turn
(`Trajectory.turn_rewards`); `get_metrics()` at the end goes to the trajectory's
`info["env_metrics"]`. A `postprocessed_action` (rewriting the model's turn as text) is refused:
the tokens the model sampled are what it is trained on.

What the environments need is checked when the data is loaded (`GymEnvironmentMaker.check`): each
row must build its environment (the columns it reads), text2sql's databases must be under `db_path`,
search's retriever must answer at `search_url` (and searchcode's at skyrl-gym's fixed URL, with a
`python` to run code). A missing one is an error naming the key to set.
"""

from __future__ import annotations

import asyncio
import copy
import math
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from inflight.rewards import RewardError, resolve
from inflight.rewards.registry import CONFIG_KEY, SKYRL_EXAMPLE_ENVIRONMENTS, is_skyrl_gym_class, skyrl_gym_id
from inflight.tasks.base import Environment, Problem, StepResult, in_thread

UNBOUNDED_TURNS = math.inf
"""`max_turns` of a skyrl-gym episode: the environment says when it is done (SkyRL's loop)."""


class EnvCalls:
    """Runs environment calls in threads (`in_thread`), at most `workers` at once per event loop; a
    call that is abandoned (its step timed out) keeps its slot until its thread returns."""

    def __init__(self, workers: int) -> None:
        if workers < 1:
            raise ValueError(f"environment.skyrl_gym.max_env_workers={workers} must be >= 1")
        self.workers = workers
        self._slots: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore] = (
            weakref.WeakKeyDictionary())

    def _semaphore(self) -> asyncio.Semaphore:
        loop = asyncio.get_running_loop()
        if loop not in self._slots:
            self._slots[loop] = asyncio.Semaphore(self.workers)
        return self._slots[loop]

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(*args)` in a thread once a slot is free."""
        slots = self._semaphore()
        await slots.acquire()
        future = in_thread(fn, *args)

        def free(done: asyncio.Future) -> None:
            slots.release()
            if not done.cancelled():
                done.exception()  # retrieved: an abandoned call's error is not logged as lost

        future.add_done_callback(free)
        return await asyncio.shield(future)


@dataclass
class GymSettings:
    """What a run gives skyrl-gym's environments: `sections` (the `environment.skyrl_gym` config:
    one section per environment id, and `max_env_workers`; None: skyrl-gym's own defaults) and
    `max_turns` (`generator.max_turns`, put into every episode's `extras` as SkyRL does)."""

    sections: Any = None
    max_turns: int = 1
    calls: EnvCalls = field(init=False)

    def __post_init__(self) -> None:
        self.calls = EnvCalls(getattr(self.sections, "max_env_workers", 32))

    def env_config(self, env_id: str | None) -> Any:
        """The `env_config` an environment gets: the run's section named `env_id`, else skyrl-gym's
        own default config for it (text2sql, search), else `{}` (what SkyRL passes)."""
        section = getattr(self.sections, env_id, None) if env_id and self.sections is not None else None
        if section is not None:
            return section
        default = _package_default_configs().get(env_id or "")
        return default() if default is not None else {}


def _package_default_configs() -> dict[str, Callable[[], Any]]:
    from skyrl_gym.envs.search.env import SearchEnvConfig
    from skyrl_gym.envs.sql.env import Text2SQLEnvConfig

    return {"text2sql": Text2SQLEnvConfig, "search": SearchEnvConfig}


class SkyRLGymEnvironment(Environment):
    """One episode of a skyrl-gym environment, as this project's `Environment`."""

    keeps_stop_str = True
    max_turns = UNBOUNDED_TURNS

    def __init__(self, env: Any, problem: Problem, calls: EnvCalls) -> None:
        self.env, self.problem, self.calls = env, problem, calls

    async def reset(self) -> list[dict[str, Any]]:
        prompt = self.problem.prompt
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else copy.deepcopy(prompt)
        opening, _ = await self.calls.run(self.env.init, messages)
        return opening

    async def step(self, response: str) -> StepResult:
        out = await self.calls.run(self.env.step, response)
        if out.get("postprocessed_action") is not None:
            raise RuntimeError(
                f"{type(self.env).__name__}.step returned a postprocessed_action: rewriting the "
                "model's turn as text is not supported (the tokens it sampled are what it is "
                "trained on); post-process in the environment's observation instead"
            )
        done = bool(out["done"])
        info = dict(out.get("metadata") or {})
        if done and callable(getattr(self.env, "get_metrics", None)):
            info["env_metrics"] = self.env.get_metrics()
        observation = None if done else list(out.get("observations") or [])
        return StepResult(observation, float(out["reward"]), done, info)

    async def close(self) -> None:
        await self.calls.run(self.env.close)


class GymEnvironmentMaker:
    """Builds a skyrl-gym environment per episode (`maker(problem)`), for the `env_class` `name`:
    a registered id, or a `skyrl_gym.Env` subclass."""

    def __init__(self, name: str, target: str | type, settings: GymSettings) -> None:
        self.name, self.settings = name, settings
        self.env_id = target if isinstance(target, str) else _registered_id(target)
        self.target = target

    def extras(self, problem: Problem) -> dict[str, Any]:
        """SkyRL's `extras`: the row's other columns (a copy), `max_turns` = generator.max_turns; rows
        that are not SkyRL's get `reward_spec` from their ground truth."""
        extras = copy.deepcopy(problem.meta.get("extras") or {})
        extras.setdefault("reward_spec", {"method": "rule", "ground_truth": problem.answer})
        extras.setdefault("extra_info", dict(problem.meta.get("extra_info") or {}))
        extras["max_turns"] = self.settings.max_turns
        return extras

    def build(self, problem: Problem) -> Any:
        """The skyrl-gym environment object for one episode of `problem`."""
        import skyrl_gym
        from skyrl_gym.envs.registration import EnvSpec

        what = self.target if isinstance(self.target, str) else EnvSpec(id=self.name, entry_point=self.target)
        return skyrl_gym.make(
            what, env_config=self.settings.env_config(self.env_id), extras=self.extras(problem)
        )

    def __call__(self, problem: Problem) -> SkyRLGymEnvironment:
        return SkyRLGymEnvironment(self.build(problem), problem, self.settings.calls)

    def check(self, problems: Sequence[Problem]) -> None:
        """Before any training: the services the environment needs answer, and every row builds it."""
        from inflight.tasks.skyrl_gym_services import check_row, check_services

        check_services(self.env_id, self.settings)
        for problem in problems:
            check_row(self, problem)


def gym_environment(name: str, settings: GymSettings) -> GymEnvironmentMaker | None:
    """The maker of the skyrl-gym environment `name` names, or None when it names something else
    (one of our rewards or environments). Raises RewardError for an id skyrl-gym does not hold."""
    env_id = skyrl_gym_id(name)
    if env_id is not None:
        return GymEnvironmentMaker(name, _registered(name, env_id), settings)
    if ":" in name and is_skyrl_gym_class(obj := resolve(name)):
        return GymEnvironmentMaker(name, obj, settings)
    return None


def _registered(name: str, env_id: str) -> str:
    try:
        import skyrl_gym
    except ImportError as err:
        raise RewardError(
            f"{CONFIG_KEY}={name!r} is a skyrl-gym environment, and skyrl-gym is not installed: "
            "pip install 'inflight[environments]' (or skyrl-gym==0.4.0)"
        ) from err
    if env_id not in skyrl_gym.registry and env_id in SKYRL_EXAMPLE_ENVIRONMENTS:  # as SkyRL's example does
        skyrl_gym.register(id=env_id, entry_point=SKYRL_EXAMPLE_ENVIRONMENTS[env_id])
    if env_id not in skyrl_gym.registry:
        raise RewardError(
            f"{CONFIG_KEY}={name!r}: skyrl-gym has no environment {env_id!r} (it holds "
            f"{', '.join(sorted(skyrl_gym.registry))}); register yours with skyrl_gym.register, "
            "or give its class as package.module:Class"
        )
    return env_id


def _registered_id(cls: type) -> str | None:
    """The id a class registered itself under in skyrl-gym's registry (by class or by
    `module:Class` entry point), if any: the `environment.skyrl_gym` section it gets."""
    import skyrl_gym

    name = f"{cls.__module__}:{cls.__qualname__}"
    return next((spec.id for spec in skyrl_gym.registry.values() if spec.entry_point in (cls, name)), None)
