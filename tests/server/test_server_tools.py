"""Tools on /v1/chat/completions through the official `openai` client, on a real model and engine.

The prompt side is compared with the tokenizer's own `apply_chat_template(..., tools=...)` under
Qwen2.5's chat template. For the output side the model is a real Qwen2 checkpoint whose weights make
it a bigram model (attention and MLP outputs zeroed, so each next token depends on the current one
only) that writes, greedily and whatever the prompt, one text then two Hermes-format tool calls
through tokens `<tool_call>`/`</tool_call>` (added tokens, as in Qwen2.5's tokenizer), then EOS.
"""

from __future__ import annotations

import json

import httpx
import pytest
from openai import OpenAI
from tool_model import CHAIN, CONTENT, TIME, TOOLS, WEATHER, make_tool_model
from transformers import AutoTokenizer

from inflight.engine import EngineConfig
from inflight.server.launch import serve_model

USER = [{"role": "user", "content": "weather in Paris, and the time?"}]


@pytest.fixture(scope="module")
def tool_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("tool-model")
    make_tool_model(path)
    return path


@pytest.fixture(scope="module")
def tool_server(tool_model):
    srv = serve_model(EngineConfig(model=str(tool_model), block_size=16), "tools")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(tool_server) -> OpenAI:
    return OpenAI(base_url=f"{tool_server.url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def tool_tokenizer(tool_model):
    return AutoTokenizer.from_pretrained(tool_model)


def template_ids(tokenizer, messages, tools) -> list[int]:
    return list(tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True)["input_ids"])


def test_tools_and_tool_turns_render_as_the_tokenizers_template(client, tool_tokenizer):
    """Tools in the system prompt, an assistant turn with tool_calls (arguments as the client's JSON
    strings) and tool results: the prompt ids equal apply_chat_template's with arguments as objects."""
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}
    sent = [{"role": "system", "content": "be brief"}, *USER,
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
            {"role": "user", "content": "thanks"}]
    rendered = [sent[0], sent[1],
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                                      "arguments": {"city": "Paris"}}}]},
                sent[3], sent[4]]
    want = template_ids(tool_tokenizer, rendered, TOOLS)
    assert "<tool_response>" in tool_tokenizer.decode(want) and '"get_time"' in tool_tokenizer.decode(want)
    for choice in ("auto", "none"):  # "none" still offers the tools (vLLM >= 0.10, OpenAI)
        r = client.chat.completions.create(model="tools", messages=sent, tools=TOOLS, tool_choice=choice,
                                           max_tokens=1, extra_body={"return_token_ids": True})
        assert r.model_extra["prompt_token_ids"] == want
        assert r.usage.prompt_tokens == len(want)


def test_tool_calls_come_back_as_tool_calls(client, tool_tokenizer):
    r = client.chat.completions.create(
        model="tools",
        messages=USER,
        tools=TOOLS,
        max_tokens=20,
        temperature=0,
        extra_body={"return_token_ids": True},
    )
    choice = r.choices[0]
    assert choice.model_extra["token_ids"] == tool_tokenizer.convert_tokens_to_ids(CHAIN) + [
        tool_tokenizer.eos_token_id]  # the model really wrote the chain
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == CONTENT
    calls = choice.message.tool_calls
    assert [(c.type, c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("function", WEATHER["name"], WEATHER["arguments"]), ("function", TIME["name"], TIME["arguments"])]
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)


def test_tool_choice_none_parses_nothing(client):
    r = client.chat.completions.create(model="tools", messages=USER, tools=TOOLS, tool_choice="none",
                                       max_tokens=20, temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "stop" and choice.message.tool_calls is None
    assert choice.message.content == "".join(CHAIN)


def test_streamed_tool_calls_reassemble_to_the_non_streamed_ones(client):
    kwargs = dict(model="tools", messages=USER, tools=TOOLS, max_tokens=20, temperature=0)
    full = client.chat.completions.create(**kwargs).choices[0]
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    contents = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert "".join(contents) == CONTENT and not any("<tool" in c for c in contents)  # block text held back
    deltas = [t for c in chunks if c.choices for t in (c.choices[0].delta.tool_calls or [])]
    assert [d.index for d in deltas] == [0, 1]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    with client.chat.completions.stream(**kwargs) as stream:  # the client's own reassembly
        final = stream.get_final_completion().choices[0]
    assert final.finish_reason == "tool_calls" and final.message.content == full.message.content
    assert [(c.function.name, json.loads(c.function.arguments)) for c in final.message.tool_calls] == [
        (c.function.name, json.loads(c.function.arguments)) for c in full.message.tool_calls]


def test_unsupported_tool_choices_and_bad_tool_turns_are_400(tool_server, client):
    body = {"model": "tools", "messages": USER, "tools": TOOLS, "max_tokens": 2}
    bad_args = [*USER, {"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": "{not json"}}]}]
    cases = [
        ({**body, "tool_choice": "required"}, "tool_choice", "unsupported_parameter"),
        ({**body, "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice",
         "unsupported_parameter"),
        ({**body, "tool_choice": "sometimes"}, "tool_choice", "invalid_value"),
        ({**body, "parallel_tool_calls": False}, "parallel_tool_calls", "unsupported_parameter"),
        ({**body, "tools": [{"type": "function", "function": {"description": "no name"}}]},
         "tools[0].function.name", "invalid_value"),
        ({**body, "messages": bad_args}, "messages[1].tool_calls[0].function.arguments", "invalid_value"),
    ]
    for payload, param, code in cases:
        r = httpx.post(f"{tool_server.url}/v1/chat/completions", json=payload, timeout=30)
        assert r.status_code == 400, r.text
        assert (r.json()["error"]["param"], r.json()["error"]["code"]) == (param, code)
    ok = client.chat.completions.create(model="tools", messages=USER, tools=TOOLS, max_tokens=20,
                                        parallel_tool_calls=True)
    assert ok.choices[0].finish_reason == "tool_calls"  # still serving
