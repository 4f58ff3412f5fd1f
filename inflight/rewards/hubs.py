"""Environment hubs: where an `environment.env_class` name (or a row's `env_class`) finds its environment.

`HUBS` holds one entry per hub: which names are its, what it needs installed and how to install it,
whether its episodes are single- or multi-turn, and who builds them: `make` (the data task builds
the row's reward or environment, `make(name, task)`) or `agent` (an agent of the agent endpoint
plays the episodes). `find_hub(name)` is the one lookup: config validation, the data task (training
and `inflight eval`), the trainer's choice of generator and the start-up checks all ask it, and an
unknown name's error lists every hub.

It lives here, not in `inflight.tasks`, because validating a config must not import torch (tasks
does): the builders, above this package, are named by `package.module:name` and imported when first
used. Adding a hub: its entry in `HUBS`, its builder (in `inflight.tasks.hub_makers`, or an agent
class in `inflight.agents`), and a test that a name of it resolves through `find_hub`.
"""

from __future__ import annotations

import difflib
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from inflight.import_path import import_object
from inflight.rewards.errors import RewardError
from inflight.rewards.registry import (
    CONFIG_KEY,
    SKYRL_EXAMPLE_ENVIRONMENTS,
    SKYRL_GYM_ENVIRONMENTS,
    SKYRL_GYM_PREFIX,
    VERIFIERS_PREFIX,
    reward_names,
    skyrl_gym_id,
    verifiers_id,
)


class UnknownEnvironment(RewardError):
    """A name no hub holds; `rule` and `fix` are the message's two halves (a config violation's)."""

    def __init__(self, name: str, rule: str, fix: str) -> None:
        super().__init__(f"{CONFIG_KEY}={name!r} {rule}: {fix}")
        self.rule, self.fix = rule, fix


@dataclass(frozen=True)
class Hub:
    """One environment hub (see the module docstring)."""

    name: str
    env_id: Callable[[str], str | None]
    """The id `name` stands for in this hub, else None (not this hub's name)."""
    names: Callable[[], list[str]]
    """Its bare names known without an import (listed in errors, and the did-you-mean candidates)."""
    forms: str
    """Its other names, as a pattern (`skyrl_gym:<id>`), for messages."""
    turns: Literal["single", "multi", "single or multi"]
    prefix: str | None = None
    """The `<prefix>:` its names start with, if any (not a `package.module:name` import)."""
    section: str | None = None
    """Its settings' section under `environment.` (verifiers' loader arguments, `openenv.url`, ...)."""
    make: str | None = None
    """`package.module:name` of `make(name, task) -> reward | environment class | maker`."""
    agent: str | None = None
    """`package.module:name` of the agent class that plays its episodes (`cls(env_id, args, model=)`)."""
    requires: str | None = None
    """The module it imports, in this project's venv (None: nothing beyond inflight)."""
    install: str = ""
    """How to install what it needs."""
    check: str | None = None
    """`package.module:name` of `check(cfg)`, raising with the setup steps, for what `requires` cannot
    say (verifiers lives in its own venv)."""

    def describe(self) -> str:
        """The hub and its names, as an error lists them: `skyrl-gym (aime, ..., skyrl_gym:<id>)`."""
        return f"{self.name} ({', '.join([*self.names(), self.forms] if self.forms else self.names())})"

    def missing(self, cfg: Any) -> str | None:
        """Why a run of this hub cannot start here (what is not installed, and how to install it), or None."""
        if self.requires is not None and importlib.util.find_spec(self.requires) is None:
            return (f"{CONFIG_KEY} names a {self.name} environment, and {self.requires} is not installed: "
                    f"{self.install}")
        if self.check is not None:
            try:
                import_object(self.check, CONFIG_KEY, RewardError)(cfg)
            except Exception as err:  # noqa: BLE001 - the check's own message says what to do
                return str(err)
        return None


def _gym_names() -> list[str]:
    ours = set(reward_names())
    return [n for n in (*SKYRL_GYM_ENVIRONMENTS, *SKYRL_EXAMPLE_ENVIRONMENTS) if n not in ours]


HUBS: tuple[Hub, ...] = (
    Hub("verifiers", verifiers_id, list, f"{VERIFIERS_PREFIX}<env id>", "multi", prefix=VERIFIERS_PREFIX,
        section="verifiers", agent="inflight.agents.verifiers_env:VerifiersAgent",
        install="scripts/verifiers_venv.sh (verifiers lives in its own venv, .venv-verifiers)",
        check="inflight.agents.verifiers_env:check_verifiers_venv"),
    Hub("openenv", lambda name: name if name == "openenv" else None, lambda: ["openenv"], "", "multi",
        section="openenv", make="inflight.tasks.hub_makers:openenv", requires="openenv",
        install="pip install 'inflight[agents]' (or openenv-core==0.3.0)"),
    Hub("skyrl-gym", skyrl_gym_id, _gym_names, f"{SKYRL_GYM_PREFIX}<id>", "multi", prefix=SKYRL_GYM_PREFIX,
        section="skyrl_gym", make="inflight.tasks.hub_makers:skyrl_gym", requires="skyrl_gym",
        install="pip install 'inflight[environments]' (or skyrl-gym==0.4.0)"),
    Hub("ours", lambda name: name if ":" in name or name in reward_names() else None, reward_names,
        "package.module:name", "single or multi", make="inflight.tasks.hub_makers:ours"),
)
"""The hubs, asked in this order: the first whose `env_id` takes a name holds it."""


def find_hub(name: str) -> Hub:
    """The hub that holds the name `environment.env_class` (or a row's `env_class`) gives. Raises
    `UnknownEnvironment` listing every hub's names when none does."""
    for hub in HUBS:
        if hub.env_id(name) is not None:
            return hub
    candidates = [n for hub in HUBS for n in hub.names()]
    close = difflib.get_close_matches(name, candidates, n=1)
    hint = f"did you mean '{close[0]}'? " if close else ""
    raise UnknownEnvironment(
        name, "is not a known reward or environment (a name your own code registers must be registered "
        "before the run: inflight.rewards.register)",
        f"{hint}name one of the environment hubs: {'; '.join(hub.describe() for hub in HUBS)}")


def agent_hub(name: str | None) -> tuple[Hub, str] | None:
    """(hub, environment id) when `name` names an environment whose episodes an agent plays (a
    verifiers environment), else None (no name, another hub's, or one no hub holds)."""
    try:
        hub = find_hub(name) if name is not None else None
    except UnknownEnvironment:
        return None
    return (hub, hub.env_id(name) or "") if hub is not None and hub.agent is not None else None


def hub_problem(cfg: Any) -> str | None:
    """What `environment.env_class`'s hub needs and this machine lacks, with how to install it, or
    None (validation reports a name no hub holds)."""
    name = cfg.environment.env_class
    try:
        return find_hub(name).missing(cfg) if name is not None else None
    except UnknownEnvironment:
        return None


def hub_prefixes() -> tuple[str, ...]:
    """The `<prefix>:` forms hubs own (not `package.module:name` imports)."""
    return tuple(hub.prefix for hub in HUBS if hub.prefix is not None)


__all__ = ["HUBS", "Hub", "UnknownEnvironment", "agent_hub", "find_hub", "hub_prefixes", "hub_problem"]
