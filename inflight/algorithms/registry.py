"""Registries of advantage estimators and policy losses, by SkyRL name or `package.module:name`.

Values are plain callables with SkyRL 0.3.0's calling conventions, so a function written for SkyRL's
`AdvantageEstimatorRegistry` / `PolicyLossRegistry` registers here unchanged:

- advantage estimator: `fn(*, token_level_rewards, response_mask, index, values, gamma, lambd,
  grpo_norm_by_std, config, **kwargs) -> (advantages [B, T], returns [B, T])` (keyword arguments; take
  `**kwargs` for the ones you do not read).
- policy loss: `fn(log_probs, old_log_probs, advantages, config, loss_mask=None, rollout_logprobs=None)
  -> (loss, metrics)`, the loss a scalar summed over masked tokens (advantages arrive pre-scaled for the
  `loss_reduction`, see `reductions.scale_advantages`), metrics a dict of floats or 0-d tensors.

`config` is the `trainer.algorithm` section (attribute access, SkyRL's key names). Look a name up once
(when the run starts) and keep the callable: lookups import modules and are not meant for a hot loop.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from typing import Any, TypeVar

from inflight.import_path import import_object

F = TypeVar("F", bound=Callable[..., Any])


class Registry:
    """Names -> callables of one kind; `get` also imports `package.module:name`."""

    def __init__(self, kind: str, config_key: str) -> None:
        self.kind = kind
        self.config_key = config_key
        self._fns: dict[str, Callable[..., Any]] = {}

    def register(self, name: str, fn: F | None = None, *, override: bool = False) -> Any:
        """Register `fn` under `name` and return it; without `fn`, a decorator that does so.

        A name already registered is a ValueError unless `override=True`."""
        if fn is None:
            return lambda f: self.register(name, f, override=override)
        if not isinstance(name, str) or not name:
            raise ValueError(f"a {self.kind} name must be a non-empty string, got {name!r}")
        if ":" in name:
            raise ValueError(f"{self.kind} name {name!r}: ':' is reserved for 'package.module:name' imports")
        if not callable(fn):
            raise TypeError(f"{self.kind} {name!r} must be callable, got {type(fn).__name__}")
        if name in self._fns and self._fns[name] is not fn and not override:
            raise ValueError(
                f"{self.kind} {name!r} is already registered (as {_describe(self._fns[name])}); "
                "pick another name or pass override=True to replace it"
            )
        self._fns[name] = fn
        return fn

    def unregister(self, name: str) -> Callable[..., Any]:
        """Remove `name` and return what it named; KeyError when it is not registered."""
        if name not in self._fns:
            raise KeyError(f"no {self.kind} named {name!r}; known: {', '.join(self.names())}")
        return self._fns.pop(name)

    def names(self) -> list[str]:
        """The registered names, in registration order."""
        return list(self._fns)

    def __contains__(self, name: object) -> bool:
        return name in self._fns

    def get(self, name: str) -> Callable[..., Any]:
        """The callable registered as `name`, or the one `package.module:name` imports."""
        if name in self._fns:
            return self._fns[name]
        if isinstance(name, str) and ":" in name:
            return self._import(name)
        close = difflib.get_close_matches(str(name), self.names(), n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ValueError(
            f"{self.config_key}={name!r} is not a known {self.kind}: {hint}use one of "
            f"{', '.join(self.names())}, or 'package.module:name' for your own function"
        )

    def _import(self, name: str) -> Callable[..., Any]:
        obj = import_object(name, self.config_key)
        attr = name.partition(":")[2]
        if not callable(obj):
            raise ValueError(
                f"{self.config_key}={name!r}: {attr!r} is a {type(obj).__name__}, not a function"
            )
        return obj


def _describe(fn: Callable[..., Any]) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


ADVANTAGE_ESTIMATORS = Registry("advantage estimator", "trainer.algorithm.advantage_estimator")
POLICY_LOSSES = Registry("policy loss", "trainer.algorithm.policy_loss_type")


def register_advantage_estimator(name: str, fn: F | None = None, *, override: bool = False) -> Any:
    """Register an advantage estimator (decorator without `fn`); see the module docstring for its call."""
    return ADVANTAGE_ESTIMATORS.register(name, fn, override=override)


def register_policy_loss(name: str, fn: F | None = None, *, override: bool = False) -> Any:
    """Register a policy loss (decorator without `fn`); see the module docstring for its call."""
    return POLICY_LOSSES.register(name, fn, override=override)


def get_advantage_estimator(name: str) -> Callable[..., Any]:
    """The estimator `trainer.algorithm.advantage_estimator=name` selects."""
    return ADVANTAGE_ESTIMATORS.get(name)


def get_policy_loss(name: str) -> Callable[..., Any]:
    """The loss `trainer.algorithm.policy_loss_type=name` selects."""
    return POLICY_LOSSES.get(name)
