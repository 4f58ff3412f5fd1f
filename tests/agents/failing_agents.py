"""An agent whose episodes fail on purpose (`generator.agent.path=failing_agents:agent`), through the
openai client: each episode of a problem takes the next role of `ROLES[problem.id]` (in the order
the episodes start): `before` raises before any model call, `after` raises after one, and a number
makes one call and returns that number as the reward."""

from __future__ import annotations

import openai

ROLES: dict[str, list[str]] = {}
STARTED: dict[str, int] = {}


async def agent(base_url: str, api_key: str, problem) -> float:
    roles = ROLES[problem.id]
    role = roles[STARTED.get(problem.id, 0) % len(roles)]  # before any await: episodes start in order
    STARTED[problem.id] = STARTED.get(problem.id, 0) + 1
    if role == "before":
        raise ConnectionError("the agent's sandbox is unreachable")
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key)
    await client.chat.completions.create(
        model="policy", messages=[{"role": "user", "content": problem.prompt}]
    )
    if role == "after":
        raise RuntimeError("the agent's tool crashed")
    return float(role)
