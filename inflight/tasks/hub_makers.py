"""What builds each environment hub's rewards and environments for a data task's rows: the `make` of
`inflight.rewards.hubs.HUBS`' entries, `make(name, task) -> reward | environment class | maker`
(`task`: the `DataTask`, whose `skyrl_gym` and `openenv` settings they read)."""

from __future__ import annotations

from typing import Any

from inflight.rewards import environment_class, get_reward
from inflight.tasks.openenv_env import openenv_environment
from inflight.tasks.skyrl_gym_env import gym_environment


def ours(name: str, task: Any) -> Any:
    """A reward function or an environment class of ours or yours (a `package.module:Class` that
    subclasses `skyrl_gym.Env` is built as skyrl-gym builds it)."""
    maker = gym_environment(name, task.skyrl_gym)
    if maker is not None:
        return maker
    cls = environment_class(name)
    return cls if cls is not None else get_reward(name)


def skyrl_gym(name: str, task: Any) -> Any:
    """The maker of a skyrl-gym environment by id (`aime`, `skyrl_gym:<id>`)."""
    return gym_environment(name, task.skyrl_gym)


def openenv(name: str, task: Any) -> Any:
    """The environment class of an OpenEnv server (`environment.openenv`)."""
    return openenv_environment(task.openenv)


__all__ = ["openenv", "ours", "skyrl_gym"]
