"""Verifiable rewards by name: `get_reward(name)` returns `(response, ground_truth, **extra) -> float`.

Built-ins: `gsm8k` (SkyRL's strict `#### <number>` rule; `gsm8k_flexible` or `method="flexible"`:
the last number), `math` (the last `\\boxed{...}`, compared with math-verify), `exact`, `contains`,
`regex`; `register(name, fn)` adds one; `package.module:name` imports a user's reward function or
environment class. `await score(reward, response, ground_truth, **extra)` runs either kind, sync or
async. Nothing here imports the rest of inflight (environment classes' rewards import
`inflight.tasks.base` when called).
"""

from inflight.rewards.errors import RewardError
from inflight.rewards.gsm8k import extract_gsm8k_answer, gsm8k_ground_truth
from inflight.rewards.math_answer import last_boxed
from inflight.rewards.registry import (
    CONFIG_KEY,
    Reward,
    environment_class,
    get_reward,
    is_environment_class,
    register,
    resolve,
    reward_names,
    score,
)

__all__ = [
    "CONFIG_KEY",
    "Reward",
    "RewardError",
    "environment_class",
    "extract_gsm8k_answer",
    "get_reward",
    "gsm8k_ground_truth",
    "is_environment_class",
    "last_boxed",
    "register",
    "resolve",
    "reward_names",
    "score",
]
