"""The agent endpoint: real agent clients (the OpenAI Agents SDK, litellm, the openai client) talk to a
session; every call is recorded as the engine answered it and a session's calls become one
token-in/token-out sample whose tokens are the engine's own (the oracle: the engine's outputs)."""

from __future__ import annotations

import os

import httpx
import openai
import pytest
import torch
from agent_model import CONTENT, TOOL
from safetensors.torch import load_file
from support import EngineRecords, assert_sample_is_the_engines, run
from transformers import AutoTokenizer

from inflight.agents import AgentEndpoint, SessionSampling, merge_calls
from inflight.client.base import update_weights
from inflight.engine import AsyncEngine, EngineConfig, LLMEngine

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # litellm reads its model list from the package
GREEDY = SessionSampling(temperature=0.0, max_tokens=32)


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLMEngine(EngineConfig(model=str(model_dir), block_size=16))


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


async def _serve(llm, tokenizer, **kwargs):
    client = EngineRecords(AsyncEngine(llm))
    endpoint = await AgentEndpoint(client, tokenizer, model_name="tiny", max_model_len=1024, **kwargs).start()
    return client, endpoint


async def _stop(client, endpoint):
    await endpoint.close()
    await client.engine.close()


async def _agents_sdk(base_url: str, api_key: str, responses: bool, streamed: bool) -> list[str]:
    from agents import (
        Agent,
        OpenAIChatCompletionsModel,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )
    from agents.exceptions import MaxTurnsExceeded

    set_tracing_disabled(True)
    cities: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """Weather in a city."""
        cities.append(city)
        return f"sunny in {city}"

    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key)
    kind = OpenAIResponsesModel if responses else OpenAIChatCompletionsModel
    agent = Agent(name="weather", instructions="Answer with the tool.", tools=[get_weather],
                  model=kind(model="any-name", openai_client=client))
    try:  # the model calls the tool every turn: two model calls, then the SDK's turn limit
        if streamed:
            result = Runner.run_streamed(agent, "Weather in Paris?", max_turns=2)
            async for _ in result.stream_events():
                pass
        else:
            await Runner.run(agent, "Weather in Paris?", max_turns=2)
    except MaxTurnsExceeded:
        pass
    return cities


@pytest.mark.parametrize("responses", [False, True], ids=["chat", "responses"])
@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "streamed"])
def test_an_agents_sdk_session_is_one_sample_of_the_engines_tokens(llm, tokenizer, responses, streamed):
    async def main():
        client, endpoint = await _serve(llm, tokenizer)
        try:
            session = endpoint.open_session(GREEDY)
            cities = await _agents_sdk(endpoint.base_url(session), session.token, responses, streamed)
            return cities, session.records, client.outputs
        finally:
            await _stop(client, endpoint)

    cities, records, outputs = run(main())
    assert cities == ["Paris", "Paris"]  # the tool ran after each model call
    assert len(records) == 2 and len(outputs) == 2
    assert records[0].chat.reply == ("assistant", CONTENT, (("get_weather", '{"city": "Paris"}'),), ())
    merged = merge_calls(records)
    assert merged.new_samples == 0 and len(merged.samples) == 1
    sample = merged.samples[0]
    assert sample.calls == [0, 1] and sample.prompt_ids == list(outputs[0].prompt_token_ids)
    assert sample.tokens == list(outputs[1].prompt_token_ids) + list(outputs[1].output_token_ids)
    assert_sample_is_the_engines(sample, outputs)
    observation = tokenizer.decode(
        [t for t, m in zip(sample.response_ids, sample.loss_mask, strict=True) if not m]
    )
    assert "<tool_response>\nsunny in Paris\n</tool_response>" in observation
    assert observation.endswith("<|im_start|>assistant\n") and not observation.startswith("<|im_end|>")


def test_a_weight_update_inside_a_session_gives_one_sample_both_versions(model_dir, tokenizer):
    import litellm

    llm = LLMEngine(EngineConfig(model=str(model_dir), block_size=16))
    weights = load_file(model_dir / "model.safetensors")
    noise = torch.Generator().manual_seed(0)
    new = [(k, v + 0.01 * torch.randn(v.shape, generator=noise)) for k, v in weights.items()]

    async def main():
        client, endpoint = await _serve(llm, tokenizer)
        try:
            session = endpoint.open_session(GREEDY)
            messages = [{"role": "user", "content": "Weather in Paris?"}]
            for turn in range(2):
                if turn == 1:  # the trainer's sync lands between the agent's two calls
                    assert await update_weights(client, new) == 1
                response = await litellm.acompletion(model="openai/any", api_base=endpoint.base_url(session),
                                                     api_key=session.token, messages=messages, tools=[TOOL])
                message = response.choices[0].message
                messages.append(message.model_dump(exclude_none=True))
                messages += [
                    {"role": "tool", "tool_call_id": c.id, "content": "sunny"} for c in message.tool_calls
                ]
            return session.records, client.outputs
        finally:
            await _stop(client, endpoint)

    records, outputs = run(main())
    merged = merge_calls(records)
    assert len(merged.samples) == 1
    sample = merged.samples[0]
    assert {v for v, m in zip(sample.versions, sample.loss_mask, strict=True) if m} == {0, 1}
    assert_sample_is_the_engines(sample, outputs)


def test_a_rewritten_history_starts_a_new_sample_never_retokenised(llm, tokenizer):
    async def main():
        client, endpoint = await _serve(llm, tokenizer)
        try:
            session = endpoint.open_session(GREEDY)
            oai = openai.AsyncOpenAI(base_url=endpoint.base_url(session), api_key=session.token)
            messages = [{"role": "user", "content": "Weather in Paris?"}]
            first = await oai.chat.completions.create(model="m", messages=messages, tools=[TOOL])
            reply = first.choices[0].message.model_dump(exclude_none=True)
            tool = {"role": "tool", "tool_call_id": reply["tool_calls"][0]["id"], "content": "sunny"}
            summary = [{"role": "user", "content": "Earlier: you asked for the weather. Go on."}]
            await oai.chat.completions.create(model="m", messages=[*messages, reply, tool], tools=[TOOL])
            # a compacted history
            await oai.chat.completions.create(model="m", messages=summary, tools=[TOOL])
            return session.records, client.outputs
        finally:
            await _stop(client, endpoint)

    records, outputs = run(main())
    merged = merge_calls(records)
    assert merged.new_samples == 1 and [s.calls for s in merged.samples] == [[0, 1], [2]]
    for sample in merged.samples:
        assert_sample_is_the_engines(sample, outputs)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Earlier: you asked for the weather. Go on."}],
        tools=[TOOL],
        add_generation_prompt=True,
        tokenize=False,
    )
    # rendered anew
    assert merged.samples[1].prompt_ids == tokenizer(text, add_special_tokens=False)["input_ids"]


def test_a_text_completion_session_continues_from_the_sampled_ids(llm, tokenizer):
    async def main():
        client, endpoint = await _serve(llm, tokenizer)
        try:
            session = endpoint.open_session(GREEDY)
            oai = openai.AsyncOpenAI(base_url=endpoint.base_url(session), api_key=session.token)
            first = await oai.completions.create(model="m", prompt="Weather?", max_tokens=5)
            text = "Weather?" + first.choices[0].text + " Tool says: sunny."
            await oai.completions.create(model="m", prompt=text, max_tokens=5)
            return session.records, client.outputs
        finally:
            await _stop(client, endpoint)

    records, outputs = run(main())
    merged = merge_calls(records)
    assert len(merged.samples) == 1 and merged.samples[0].calls == [0, 1]
    assert_sample_is_the_engines(merged.samples[0], outputs)


def test_every_request_needs_a_live_sessions_token_and_the_runs_sampling_applies(llm, tokenizer):
    async def main():
        client, endpoint = await _serve(llm, tokenizer, served_model_name="policy")
        try:
            session = endpoint.open_session(SessionSampling(temperature=0.5, top_p=0.9, top_k=7, max_tokens=3,
                                                            seed=(1, 2)))
            body = {"model": "policy", "messages": [{"role": "user", "content": "hi"}], "temperature": 0.0,
                    "max_tokens": 50}
            async with httpx.AsyncClient(base_url=endpoint.url, timeout=30) as http:
                statuses = [
                    (await http.post("/v1/chat/completions", json=body)).status_code,
                    (
                        await http.post(
                            "/v1/chat/completions", json=body, headers={"Authorization": "Bearer nope"}
                        )
                    ).status_code,
                    (
                        await http.post(
                            "/v1/chat/completions",
                            json={**body, "model": "other"},
                            headers={"Authorization": f"Bearer {session.token}"},
                        )
                    ).status_code,
                ]
                other = endpoint.open_session(GREEDY)
                mismatch = await http.post(f"/sessions/{session.token}/v1/chat/completions", json=body,
                                           headers={"Authorization": f"Bearer {other.token}"})
                ok = await http.post(f"/sessions/{session.token}/v1/chat/completions", json=body,
                                     headers={"Authorization": "Bearer whatever-the-sdk-wants"})
                version = await http.get(f"/sessions/{session.token}/weight_version")
                endpoint.close_session(session)
                closed = await http.post("/v1/chat/completions", json=body,
                                         headers={"Authorization": f"Bearer {session.token}"})
            return statuses, mismatch, ok, version, closed, client.outputs
        finally:
            await _stop(client, endpoint)

    statuses, mismatch, ok, version, closed, outputs = run(main())
    assert statuses == [401, 401, 404]
    assert mismatch.status_code == 401 and "different sessions" in mismatch.text
    assert ok.status_code == 200 and version.json() == {"weight_version": 0}
    assert closed.status_code == 401 and "no live session" in closed.text
    assert len(outputs) == 1 and len(outputs[0].output_token_ids) == 3  # max_tokens capped by the run's
    assert outputs[0].logprobs is not None and len(outputs[0].logprobs) == 3  # always recorded
