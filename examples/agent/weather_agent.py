"""An OpenAI Agents SDK agent with a function tool, as `inflight train` trains it.

The run calls `agent(base_url, api_key, problem)` once per episode: `base_url` and `api_key` are the
episode's session on the run's agent endpoint (an OpenAI-compatible server over the policy being
trained), `problem` is a row of the data (`problem.prompt`, `problem.answer`, `problem.meta`). Every
model call the agent makes is recorded token for token and trained on; what it returns is the
episode's reward (or `(reward, info)`).
"""

from __future__ import annotations

from agents import Agent, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled
from agents.exceptions import AgentsException
from openai import AsyncOpenAI

set_tracing_disabled(True)  # no traces sent to OpenAI
FORECASTS = {"Paris": "sunny, 21 C", "Rome": "cloudy, 18 C", "Oslo": "snow, -3 C", "Lima": "fog, 16 C"}


async def agent(base_url: str, api_key: str, problem) -> tuple[float, dict]:
    """Ask for the weather; reward 1 when the model called the tool for the right city and its final
    answer repeats the forecast."""
    asked: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """Today's weather in a city."""
        asked.append(city)
        return FORECASTS.get(city, "unknown city")

    client = AsyncOpenAI(base_url=base_url, api_key=api_key)
    model = OpenAIChatCompletionsModel(model="policy", openai_client=client)
    weather = Agent(name="weather", instructions="Call get_weather, then answer with the forecast.",
                    tools=[get_weather], model=model)
    try:
        result = await Runner.run(weather, problem.prompt, max_turns=4)
        answer = str(result.final_output)
    except AgentsException as err:  # too many turns, a malformed tool call: the episode scores 0
        return 0.0, {"error": type(err).__name__, "asked": asked}
    right = problem.answer in asked and FORECASTS[problem.answer].split(",")[0] in answer
    return float(right), {"asked": asked}
