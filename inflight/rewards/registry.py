"""Rewards by name: the built-ins, names added with `register`, `package.module:name` (a user's
reward function or environment class, imported on first use), and how skyrl-gym's and verifiers'
names read (`skyrl_gym_id`, `verifiers_id`: those hubs' entries in `inflight.rewards.hubs`, the one
lookup of an `environment.env_class` name)."""

from __future__ import annotations

import difflib
import inspect
import sys
from collections.abc import Awaitable, Callable
from typing import Any

from inflight.import_path import import_object
from inflight.rewards.errors import RewardError
from inflight.rewards.gsm8k import gsm8k_flexible_reward, gsm8k_reward
from inflight.rewards.math_answer import math_reward
from inflight.rewards.text import contains_reward, exact_reward, regex_reward

Reward = Callable[..., float | Awaitable[float]]
"""`(response: str, ground_truth: str, **extra) -> float` (or an `async def` returning one);
1.0 means correct. `extra` holds the row's `extra_info` (e.g. `method`, `pattern`)."""

CONFIG_KEY = "environment.env_class"

_BUILTINS: dict[str, Reward] = {
    "gsm8k": gsm8k_reward,
    "gsm8k_flexible": gsm8k_flexible_reward,
    "math": math_reward,
    "exact": exact_reward,
    "contains": contains_reward,
    "regex": regex_reward,
}
_REGISTRY: dict[str, Reward] = dict(_BUILTINS)
_IMPORTED: dict[str, Any] = {}
# Built-in environments, named here and imported on first use: they live above this package
# (inflight.tasks), which imports it.
_BUILTIN_ENVIRONMENTS = {"tool": "inflight.tasks.tool_env:ToolEnv"}
SKYRL_GYM_PREFIX = "skyrl_gym:"
SKYRL_EXAMPLE_ENVIRONMENTS = {"multiply": "inflight.tasks.skyrl_examples:MultiplyEnv",
                              "llm_as_a_judge": "inflight.tasks.skyrl_examples:LLMJudgeEnv"}
"""Environments SkyRL's example entry points register into skyrl-gym (by id: ours, with the same
behaviour), registered under that id when a run first builds one (`inflight.tasks.skyrl_examples`)."""
SKYRL_GYM_ENVIRONMENTS = ("aime", "gsm8k", "gsm8k_multi_turn", "lcb", "search", "searchcode", "text2sql")
"""The environments skyrl-gym 0.4.0 registers. A bare name that is also one of ours (`gsm8k`) is ours;
`skyrl_gym:<id>` always names skyrl-gym's (any id its registry holds when the run starts)."""
VERIFIERS_PREFIX = "verifiers:"
"""`verifiers:<env id>`: a verifiers environment, played through the agent endpoint by its own worker
(`inflight.agents.verifiers_env`); it is not a reward."""


def verifiers_id(name: str | None) -> str | None:
    """The verifiers environment id of `name` (`verifiers:<id>`; the id may be empty), else None."""
    return name[len(VERIFIERS_PREFIX):] if name is not None and name.startswith(VERIFIERS_PREFIX) else None


def skyrl_gym_id(name: str) -> str | None:
    """The skyrl-gym environment id `name` stands for (`skyrl_gym:<id>`, or a name that is not ours:
    one of `SKYRL_GYM_ENVIRONMENTS`, or an id your code registered in skyrl-gym, as SkyRL's
    llm_as_a_judge example does), else None."""
    if name.startswith(SKYRL_GYM_PREFIX):
        return name[len(SKYRL_GYM_PREFIX):] or None
    if name in _REGISTRY or name in _BUILTIN_ENVIRONMENTS:
        return None
    gym = sys.modules.get("skyrl_gym")  # registered ids exist only once skyrl-gym is imported
    if (
        name in SKYRL_GYM_ENVIRONMENTS
        or name in SKYRL_EXAMPLE_ENVIRONMENTS
        or name in getattr(gym, "registry", {})
    ):
        return name
    return None


def register(name: str, fn: Reward) -> Reward:
    """Make `fn` available as `get_reward(name)` (and as `environment.env_class=name`); returns `fn`.
    Re-registering a name replaces it; the built-in names cannot be replaced."""
    if not callable(fn):
        raise TypeError(f"register({name!r}, ...): a reward must be callable, got {type(fn).__name__}")
    if name in _BUILTINS and _BUILTINS[name] is not fn:
        raise RewardError(f"{name!r} is a built-in reward; register yours under another name")
    if ":" in name:
        raise RewardError(f"{name!r}: ':' is reserved for 'package.module:name' imports")
    _REGISTRY[name] = fn
    return fn


def reward_names() -> list[str]:
    """The names `get_reward` knows without an import (built-ins first, then registered ones)."""
    return [*_REGISTRY, *(name for name in _BUILTIN_ENVIRONMENTS if name not in _REGISTRY)]


def resolve(name: str) -> Any:
    """The object `name` stands for: a registered reward, or what `package.module:name` imports (a
    reward function or an environment class). Raises RewardError naming `environment.env_class`."""
    if name in _REGISTRY:
        return _REGISTRY[name]
    if name in _BUILTIN_ENVIRONMENTS:
        return resolve(_BUILTIN_ENVIRONMENTS[name])
    if skyrl_gym_id(name) is not None:
        raise RewardError(f"{CONFIG_KEY}={name!r} is a skyrl-gym environment: build it with "
                          "inflight.tasks.skyrl_gym_env (DataTask does), not as a reward")
    if verifiers_id(name) is not None:
        raise RewardError(
            f"{CONFIG_KEY}={name!r} is a verifiers environment: it plays its episodes through the "
            "agent endpoint of `inflight train` (its rubric is the reward), not as a reward here"
        )
    if ":" not in name:
        names = [*reward_names(), *(n for n in SKYRL_GYM_ENVIRONMENTS if n not in reward_names())]
        close = difflib.get_close_matches(name, names, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise RewardError(
            f"{CONFIG_KEY}={name!r} is not a known reward: {hint}use one of "
            f"{', '.join(names)}, skyrl_gym:<id> for a skyrl-gym environment, or 'package.module:name' "
            "for your own function or environment"
        )
    if name not in _IMPORTED:
        _IMPORTED[name] = _import(name)
    return _IMPORTED[name]


def _import(name: str) -> Any:
    obj = import_object(name, CONFIG_KEY, RewardError)
    attr = name.partition(":")[2]
    if not callable(obj):
        raise RewardError(
            f"{CONFIG_KEY}={name!r}: {attr!r} is a {type(obj).__name__}, not a reward "
            "function or an environment class"
        )
    return obj


def is_environment_class(obj: Any) -> bool:
    """Whether `obj` is an environment class (a class with `reset` and `step`) rather than a reward."""
    return (
        inspect.isclass(obj)
        and callable(getattr(obj, "step", None))
        and callable(getattr(obj, "reset", None))
    )


def is_skyrl_gym_class(obj: Any) -> bool:
    """Whether `obj` is a skyrl-gym environment class (a subclass of `skyrl_gym.Env`: `init` / `step`
    / `close`), told apart without importing skyrl-gym."""
    return inspect.isclass(obj) and any(
        (c.__module__, c.__name__) == ("skyrl_gym.core", "Env") for c in obj.__mro__
    )


def environment_class(name: str) -> type | None:
    """The environment class `name` imports, or None when `name` is a reward function."""
    obj = resolve(name)
    return obj if is_environment_class(obj) else None


def get_reward(name: str | Reward) -> Reward:
    """The reward `name` stands for (`gsm8k`, `gsm8k_flexible`, `math`, `exact`, `contains`, `regex`,
    a registered name, or `package.module:name` naming a function). An environment class is refused
    here: it needs a problem, which `inflight.tasks.environment_reward` builds. A callable is
    returned unchanged."""
    if callable(name):
        return name
    obj = resolve(name)
    if is_environment_class(obj):
        raise RewardError(
            f"{CONFIG_KEY}={name!r} is an environment class, not a reward function: give it as "
            "environment.env_class, or score one response with "
            "inflight.tasks.environment_reward(cls)"
        )
    if inspect.isclass(obj):
        raise RewardError(
            f"{CONFIG_KEY}={name!r} is a class without reset() and step(): give a reward "
            "function or an environment class"
        )
    return obj


async def score(reward: str | Reward, response: str, ground_truth: str, **extra: Any) -> float:
    """`reward(response, ground_truth, **extra)` as a float, awaited when the reward is async (a sync
    reward runs directly, in the caller's thread). Raises RewardError when it returns no number."""
    fn = get_reward(reward)
    value = fn(response, ground_truth, **extra)
    if inspect.isawaitable(value):
        value = await value
    if isinstance(value, bool) or isinstance(value, int | float):
        return float(value)
    try:
        return float(value)  # numpy / torch scalars
    except (TypeError, ValueError):
        raise RewardError(
            f"reward {getattr(fn, '__name__', fn)!r} returned {type(value).__name__} {value!r}, not a number"
        ) from None
