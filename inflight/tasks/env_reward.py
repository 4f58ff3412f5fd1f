"""An environment class's single-turn score as a reward function.

Lives here, not in `inflight.rewards`, because it builds a `Problem`: rewards sit below tasks.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable
from typing import Any

from inflight.rewards import RewardError, environment_class, is_environment_class
from inflight.rewards.registry import Reward
from inflight.tasks.base import Problem


def environment_reward(env: str | type) -> Reward:
    """`(response, ground_truth, **extra) -> reward` of one turn of the environment `env` (a class
    or its `environment.env_class` name): the class built for a problem with that ground truth,
    `reset()`, then `step(response).reward` (awaited when `step` is a coroutine)."""
    cls = environment_class(env) if isinstance(env, str) else env
    if cls is None or not is_environment_class(cls):
        raise RewardError(f"{env!r} is not an environment class (a class with reset() and step())")

    def reward(response: str, ground_truth: str, **extra: Any) -> float | Awaitable[float]:
        problem = Problem(
            "reward", "", str(ground_truth), meta={"ground_truth": ground_truth, "extra_info": dict(extra)}
        )
        instance = cls(problem)
        instance.reset()
        result = instance.step(response)
        return _awaited_reward(result) if inspect.isawaitable(result) else result.reward

    reward.__name__ = f"{cls.__name__}_reward"
    return reward


async def _awaited_reward(result: Awaitable[Any]) -> float:
    return (await result).reward
