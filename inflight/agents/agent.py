"""Your agent, as the run calls it: `agent(base_url, api_key, problem) -> reward | (reward, info)`.

`generator.agent.path` names it as `package.module:name`: a function (`async def`, or a plain
function, which runs in a worker thread so its blocking calls do not stop the endpoint it talks
to), or a class with the same call (`__call__`), made once per run with no arguments. `base_url`
is the episode's OpenAI base URL (`http://host:port/sessions/<token>/v1`), `api_key` its token,
`problem` the `inflight.tasks.Problem` (`id`, `prompt`, `answer`, `meta`: the data row's other
columns). It returns the episode's reward (a number) or `(reward, info)` with a dict of what to keep
beside the sample.
"""

from __future__ import annotations

import asyncio
import inspect
import math
from collections.abc import Callable
from typing import Any

from inflight.import_path import import_object

CONFIG_KEY = "generator.agent.path"


class AgentError(ValueError):
    """The agent cannot be loaded, or answered something that is not a reward."""


class AgentStopped(AgentError):
    """The agent can play no more episodes (e.g. the process that plays them died): the run stops with
    this error instead of scoring every later episode 0."""


def load_agent(path: str) -> Callable[..., Any]:
    """The agent `path` (`package.module:name`) names: its function, or an instance of its class."""
    obj = import_object(path, CONFIG_KEY, AgentError)
    if inspect.isclass(obj):
        try:
            obj = obj()
        except Exception as err:
            raise AgentError(f"{CONFIG_KEY}={path!r}: the class could not be made with no arguments "
                             f"({type(err).__name__}: {err})") from err
    if not callable(obj):
        raise AgentError(f"{CONFIG_KEY}={path!r} is a {type(obj).__name__}: give an agent function "
                         "`agent(base_url, api_key, problem)` or a class whose instances are called so")
    _check_signature(obj, path)
    return obj


def _check_signature(fn: Callable[..., Any], path: str) -> None:
    try:
        inspect.signature(fn).bind("base_url", "api_key", "problem")
    except TypeError as err:
        raise AgentError(f"{CONFIG_KEY}={path!r} cannot be called as agent(base_url, api_key, problem): "
                         f"{err}") from err
    except ValueError:  # builtins without a signature: called as given
        return


async def run_agent(agent: Callable[..., Any], base_url: str, api_key: str, problem: Any) -> Any:
    """Call the agent: a coroutine function (or an object whose `__call__` is one) is awaited on this
    loop; any other callable runs in a worker thread (and a coroutine it returns is awaited here)."""
    if inspect.iscoroutinefunction(agent) or inspect.iscoroutinefunction(type(agent).__call__):
        result = await agent(base_url, api_key, problem)
    else:
        result = await asyncio.to_thread(agent, base_url, api_key, problem)
    while inspect.isawaitable(result):
        result = await result
    return result


def parse_result(result: Any) -> tuple[float, dict[str, Any]]:
    """(reward, info) of what an agent returned: a number, or (number, dict)."""
    info: dict[str, Any] = {}
    if isinstance(result, tuple):
        if len(result) != 2 or not isinstance(result[1], dict):
            raise AgentError(f"the agent returned a tuple {result!r}: return a reward or (reward, info dict)")
        result, info = result
    if isinstance(result, str):
        raise AgentError(f"the agent returned the string {result!r}: return a number (the reward)")
    try:
        reward = float(result)
    except (TypeError, ValueError):
        raise AgentError(f"the agent returned {type(result).__name__} {result!r}, not a reward "
                         "(a number, or (number, info dict))") from None
    if not math.isfinite(reward):
        raise AgentError(f"the agent returned the reward {reward}, not a finite number")
    return reward, dict(info)


__all__ = ["AgentError", "AgentStopped", "load_agent", "parse_result", "run_agent"]
