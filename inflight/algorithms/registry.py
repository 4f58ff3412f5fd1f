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

A policy loss registers what it needs with itself (`PolicyLossTraits`: whether it reads the old
log-probabilities, applies the off-policy correction, is supervised); the trainer and the config's
validation read them here. A function may also be registered as its `package.module:name`, imported at
the first lookup: the built-ins are (`skyrl_calls`), so this module, and what the registries know, needs
no torch (validating a config reads it).
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from inflight.import_path import import_object

F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True)
class PolicyLossTraits:
    """What a policy loss needs and does, given when it is registered (`register_policy_loss`)."""

    needs_old_logprobs: bool = True
    """It reads the old log-probabilities. False (rollout_is, dppo: they read the rollout's): the
    trainer skips that forward when nothing else (KL in the reward, distillation, the off-policy
    correction) needs them, as SkyRL does, and the loss gets None."""
    applies_off_policy_correction: bool = True
    """It applies `trainer.algorithm.off_policy_correction`. False (clip_cov, kl_cov, cross_entropy,
    importance_sampling, as in SkyRL): a config that turns the correction on is refused."""
    supervised: bool = False
    """A supervised loss (cross_entropy): no KL loss and no entropy bonus is added to it (SkyRL's)."""


class Registry:
    """Names -> callables of one kind, each registered as the callable or its `package.module:name`;
    `get` also imports `package.module:name`. `traits`: the class of what an entry declares about
    itself (None: this kind declares nothing)."""

    def __init__(self, kind: str, config_key: str, traits: type | None = None) -> None:
        self.kind = kind
        self.config_key = config_key
        self._traits_type = traits
        self._fns: dict[str, Callable[..., Any] | str] = {}
        self._loaded: dict[str, Callable[..., Any]] = {}
        self._traits: dict[str, Any] = {}

    def register(self, name: str, fn: F | str | None = None, *, override: bool = False, **traits: Any) -> Any:
        """Register `fn` (a callable, or the `package.module:name` that imports it at the first lookup)
        under `name` with its `traits` (keywords of this registry's traits class) and return `fn`;
        without `fn`, a decorator that does so.

        A name already registered is a ValueError unless `override=True`."""
        if fn is None:
            return lambda f: self.register(name, f, override=override, **traits)
        if not isinstance(name, str) or not name:
            raise ValueError(f"a {self.kind} name must be a non-empty string, got {name!r}")
        if ":" in name:
            raise ValueError(f"{self.kind} name {name!r}: ':' is reserved for 'package.module:name' imports")
        if not callable(fn) and not (isinstance(fn, str) and ":" in fn):
            raise TypeError(f"{self.kind} {name!r} must be callable or 'package.module:name', got "
                            f"{type(fn).__name__}")
        declared = self._declared(name, traits)
        if name in self._fns and not self._same(name, fn) and not override:
            raise ValueError(
                f"{self.kind} {name!r} is already registered (as {_describe(self._fns[name])}); "
                "pick another name or pass override=True to replace it"
            )
        self._fns[name] = fn
        self._loaded.pop(name, None)
        self._traits[name] = declared
        return fn

    def _declared(self, name: str, traits: dict[str, Any]) -> Any:
        if self._traits_type is None:
            if traits:
                raise TypeError(f"a {self.kind} declares nothing: unexpected {', '.join(sorted(traits))}")
            return None
        known = {f.name for f in dataclasses.fields(self._traits_type)}
        if unknown := sorted(set(traits) - known):
            raise TypeError(f"{self.kind} {name!r}: unknown trait(s) {', '.join(unknown)}; a {self.kind} "
                            f"declares {', '.join(sorted(known))}")
        return self._traits_type(**traits)

    def _same(self, name: str, fn: Callable[..., Any] | str) -> bool:
        held = self._fns[name]
        return held == fn if isinstance(held, str) or isinstance(fn, str) else held is fn

    def unregister(self, name: str) -> Callable[..., Any] | str:
        """Remove `name` and return what it named; KeyError when it is not registered."""
        if name not in self._fns:
            raise KeyError(f"no {self.kind} named {name!r}; known: {', '.join(self.names())}")
        self._traits.pop(name, None)
        self._loaded.pop(name, None)
        return self._fns.pop(name)

    def names(self) -> list[str]:
        """The registered names, in registration order."""
        return list(self._fns)

    def __contains__(self, name: object) -> bool:
        return name in self._fns

    def traits(self, name: str) -> Any:
        """What `name` declared when it was registered; the defaults for a `package.module:name` or a
        name not registered (yet)."""
        if name in self._traits:
            return self._traits[name]
        return None if self._traits_type is None else self._traits_type()

    def get(self, name: str) -> Callable[..., Any]:
        """The callable registered as `name`, or the one `package.module:name` imports."""
        if name in self._fns:
            fn = self._fns[name]
            if isinstance(fn, str):  # registered by path: imported once, then held
                if name not in self._loaded:
                    self._loaded[name] = self._import(fn)
                return self._loaded[name]
            return fn
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


def _describe(fn: Callable[..., Any] | str) -> str:
    if isinstance(fn, str):
        return fn
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


ADVANTAGE_ESTIMATORS = Registry("advantage estimator", "trainer.algorithm.advantage_estimator")
POLICY_LOSSES = Registry("policy loss", "trainer.algorithm.policy_loss_type", PolicyLossTraits)


def register_advantage_estimator(name: str, fn: F | str | None = None, *, override: bool = False) -> Any:
    """Register an advantage estimator (decorator without `fn`); see the module docstring for its call."""
    return ADVANTAGE_ESTIMATORS.register(name, fn, override=override)


def register_policy_loss(name: str, fn: F | str | None = None, *, override: bool = False,
                         needs_old_logprobs: bool = True, applies_off_policy_correction: bool = True,
                         supervised: bool = False) -> Any:
    """Register a policy loss (decorator without `fn`) with what it needs (`PolicyLossTraits`); see
    the module docstring for its call."""
    return POLICY_LOSSES.register(name, fn, override=override, needs_old_logprobs=needs_old_logprobs,
                                  applies_off_policy_correction=applies_off_policy_correction,
                                  supervised=supervised)


def get_advantage_estimator(name: str) -> Callable[..., Any]:
    """The estimator `trainer.algorithm.advantage_estimator=name` selects."""
    return ADVANTAGE_ESTIMATORS.get(name)


def get_policy_loss(name: str) -> Callable[..., Any]:
    """The loss `trainer.algorithm.policy_loss_type=name` selects."""
    return POLICY_LOSSES.get(name)


def policy_loss_traits(name: str) -> PolicyLossTraits:
    """What the loss `trainer.algorithm.policy_loss_type=name` declared (`PolicyLossTraits`)."""
    return POLICY_LOSSES.traits(name)


# The built-ins, SkyRL's names, registered by path (their functions in `skyrl_calls`, which imports torch).
for _name in ("grpo", "rloo", "maxrl", "reinforce++", "gae", "no_op"):
    register_advantage_estimator(
        _name, f"inflight.algorithms.skyrl_calls:{_name.replace('++', '_plus_plus')}"
    )
for _name, _traits in {
    "regular": {}, "dual_clip": {}, "gspo": {}, "cispo": {},
    "rollout_is": {"needs_old_logprobs": False}, "dppo": {"needs_old_logprobs": False}, "sapo": {},
    "clip_cov": {"applies_off_policy_correction": False}, "kl_cov": {"applies_off_policy_correction": False},
    "cross_entropy": {"applies_off_policy_correction": False, "supervised": True},
    "importance_sampling": {"applies_off_policy_correction": False},
}.items():
    register_policy_loss(_name, f"inflight.algorithms.skyrl_calls:{_name}", **_traits)
