"""Agents the training tests train (`generator.agent.path=train_agents:<name>`): an OpenAI Agents SDK
agent with a function tool, and a litellm one, each rewarded 1 when the model called the tool with
the problem's answer. `sdk_agent`'s tool calls on the problem `WAIT["problem"]` wait for the engines'
first weight update (version 1), so those sessions span a weight update (a sync lands between their two model
calls)."""

from __future__ import annotations

import asyncio
import json
import os

import httpx

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
WAIT: dict = {"problem": None, "spanned": []}  # the problem whose tool calls wait for a weight update


async def _version(base_url: str, api_key: str) -> int:
    root = base_url.removesuffix("/v1")
    async with httpx.AsyncClient(timeout=10) as http:
        answer = await http.get(f"{root}/weight_version", headers={"Authorization": f"Bearer {api_key}"})
        return int(answer.json()["weight_version"])


async def _wait_for_update(base_url: str, api_key: str, problem_id: str) -> None:
    if problem_id != WAIT["problem"]:
        return
    for _ in range(1200):
        if await _version(base_url, api_key) >= 1:  # the first training step's sync
            WAIT["spanned"].append(problem_id)
            return
        await asyncio.sleep(0.05)
    raise TimeoutError("no weight update came within 60 s")


async def sdk_agent(base_url: str, api_key: str, problem) -> tuple[float, dict]:
    from agents import Agent, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled
    from agents.exceptions import MaxTurnsExceeded
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    cities: list[str] = []

    @function_tool
    async def get_weather(city: str) -> str:
        """Weather in a city."""
        cities.append(city)
        await _wait_for_update(base_url, api_key, problem.id)
        return f"sunny in {city}"

    model = OpenAIChatCompletionsModel(
        model="policy", openai_client=AsyncOpenAI(base_url=base_url, api_key=api_key)
    )
    agent = Agent(name="weather", instructions="Use the tool.", tools=[get_weather], model=model)
    try:
        await Runner.run(agent, problem.prompt, max_turns=2)
    except MaxTurnsExceeded:  # this model calls the tool every turn
        pass
    return float(problem.answer in cities), {"cities": cities}


async def litellm_agent(base_url: str, api_key: str, problem) -> float:
    import litellm

    messages = [{"role": "user", "content": problem.prompt}]
    called = False
    for _ in range(2):
        response = await litellm.acompletion(model="openai/policy", api_base=base_url, api_key=api_key,
                                             messages=messages, tools=[TOOL])
        message = response.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls or []:
            called = called or json.loads(call.function.arguments or "{}").get("city") == problem.answer
            messages.append({"role": "tool", "tool_call_id": call.id, "content": "sunny"})
        if not message.tool_calls:
            break
    return float(called)
