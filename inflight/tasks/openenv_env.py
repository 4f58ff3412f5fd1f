"""OpenEnv environments (`environment.env_class=openenv`): an environment server, through openenv-core's
client, plays each episode (`reset` when it starts, one `step` per model turn).

The server is `environment.openenv.url` (a running server: `http://host:port`), or
`environment.openenv.image` (a Docker image: each episode starts its own container through
openenv-core's `LocalDockerProvider`, as SkyRL's OpenEnv example does), or, with neither, the row's
`env_name` column as the image `<env_name>:latest` (SkyRL's rows). Each episode opens its own session
(openenv-core's `GenericEnvClient`, a WebSocket per episode) and closes it when the episode ends.

What the model sees and does, as SkyRL maps it: the opening prompt is the row's prompt (the reset's
observation is kept in the episode's info, not shown); a turn's action is the text inside the last
`<action>...</action>` of the response (the whole response, stripped, when it has none), sent as the
action field `environment.openenv.action_field` (null: the one required string field of the server's
action schema, from its `/schema`); the step's observation comes back as a user message (one text
field: its text; several: `name: value` lines), its reward (none: 0) is the turn's, and `done` ends
the episode (else `generator.max_turns` does).
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass
from typing import Any

from inflight.tasks.base import Environment, Problem, StepResult

OBSERVATION_SKIP = ("metadata", "done", "reward")
_ACTION = re.compile(r"<action>(.*?)</action>", re.S)


class OpenEnvError(RuntimeError):
    """The OpenEnv environment cannot be reached or used as configured."""


@dataclass(frozen=True)
class OpenEnvSettings:
    """`environment.openenv`: where the server is and which action field takes the model's text."""

    url: str | None = None
    image: str | None = None
    action_field: str | None = None

    @classmethod
    def from_config(cls, section: Any) -> OpenEnvSettings:
        return cls(section.url, section.image, section.action_field)


def action_text(response: str) -> str:
    """The action in a response: the last `<action>...</action>`'s text, else the whole response."""
    found = _ACTION.findall(response)
    return (found[-1] if found else response).strip()


def observation_text(observation: Any) -> str:
    """An observation (a dict of fields) as the text of a user message."""
    if not isinstance(observation, dict):
        return str(observation)
    fields = {k: v for k, v in observation.items() if k not in OBSERVATION_SKIP}
    if len(fields) == 1 and isinstance(next(iter(fields.values())), str):
        return next(iter(fields.values()))
    return "\n".join(f"{k}: {v}" for k, v in fields.items())


def action_field_of(schema: dict[str, Any]) -> str:
    """The one required string field of an action schema (OpenEnv's `/schema` "action")."""
    props = schema.get("properties", {})
    names = [
        n for n in schema.get("required", []) if n != "metadata" and props.get(n, {}).get("type") == "string"
    ]
    if len(names) != 1:
        raise OpenEnvError(
            f"the server's action schema has {len(names)} required text fields ({names}): name the "
            "one that takes the model's text in environment.openenv.action_field"
        )
    return names[0]


async def _schema_field(url: str) -> str:
    import httpx

    async with httpx.AsyncClient(timeout=30) as http:
        answer = await http.get(url.rstrip("/") + "/schema")
        answer.raise_for_status()
        return action_field_of(answer.json().get("action", {}))


class OpenEnvEnvironment(Environment):
    """One episode against an OpenEnv server (see the module docstring); `settings` is bound by
    `openenv_environment`."""

    settings: OpenEnvSettings = OpenEnvSettings()
    _fields: dict[str, str] = {}  # the action field found per server URL

    def __init__(self, problem: Problem) -> None:
        self.problem = problem
        self.client: Any = None
        self.url: str | None = None
        self.info: dict[str, Any] = {}

    async def _connect(self) -> Any:
        from openenv.core.generic_client import GenericEnvClient

        s = self.settings
        image = s.image or (None if s.url else _row_image(self.problem))
        if image is None and s.url is None:
            raise OpenEnvError(
                "no OpenEnv server: set environment.openenv.url (a running server) or "
                "environment.openenv.image (a Docker image), or give the rows an env_name column"
            )
        if image is None:
            self.url = s.url
            client = GenericEnvClient(base_url=s.url)
            await client.connect()
            return client
        from openenv.core.containers.runtime import LocalDockerProvider

        provider = LocalDockerProvider()
        self.url = await asyncio.to_thread(provider.start_container, image)  # blocking: off the loop
        await asyncio.to_thread(provider.wait_for_ready, self.url)
        client = GenericEnvClient(base_url=self.url, provider=provider)
        await client.connect()
        return client

    async def reset(self) -> str | list[dict[str, Any]]:
        try:
            self.client = await self._connect()
            result = await self.client.reset()
        except Exception as err:
            raise OpenEnvError(
                f"OpenEnv server {self.url or self.settings.image!r}: {type(err).__name__}: {err}"
            ) from err
        self.info["openenv_reset"] = observation_text(result.observation)
        return self.problem.prompt

    async def _field(self) -> str:
        if self.settings.action_field:
            return self.settings.action_field
        if self.url not in self._fields:
            self._fields[self.url] = await _schema_field(self.url)
        return self._fields[self.url]

    async def step(self, response: str) -> StepResult:
        result = await self.client.step({await self._field(): action_text(response)})
        reward = 0.0 if result.reward is None else float(result.reward)
        if result.done:
            return StepResult(None, reward, True, dict(self.info))
        return StepResult({"role": "user", "content": observation_text(result.observation)}, reward, False,
                          dict(self.info))

    async def close(self) -> None:
        if self.client is not None:
            client, self.client = self.client, None
            await client.close()


def _row_image(problem: Problem) -> str | None:
    name = (problem.meta.get("extras") or {}).get("env_name")
    return f"{name}:latest" if isinstance(name, str) and name else None


def openenv_environment(settings: OpenEnvSettings) -> type[OpenEnvEnvironment]:
    """The environment class of `environment.env_class=openenv` under `settings` (built per episode
    with the problem, as every environment class)."""
    if settings.url is not None and settings.image is not None:
        raise OpenEnvError("environment.openenv.url and environment.openenv.image are both set: give one")
    try:
        import openenv.core.generic_client  # noqa: F401
    except ImportError as err:
        raise OpenEnvError("environment.env_class=openenv needs openenv-core: pip install 'inflight[agents]' "
                           "(or openenv-core==0.3.0)") from err
    return type("OpenEnv", (OpenEnvEnvironment,), {"settings": settings, "_fields": {}})


__all__ = ["OpenEnvEnvironment", "OpenEnvError", "OpenEnvSettings", "action_field_of", "action_text",
           "observation_text", "openenv_environment"]
