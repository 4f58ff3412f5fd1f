"""`/v1/responses` through the official `openai` client: text and message-list input with
`instructions` equal the chat route's generation for the same conversation, streamed (both
`responses.create(stream=True)` and `responses.stream`) equal to whole, a function tool round trip
on a model that writes tool calls, and what is not supported is a 400 naming the field."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from openai import OpenAI
from tool_model import CONTENT, TIME, WEATHER, make_tool_model
from transformers import AutoTokenizer

from inflight.engine import EngineConfig
from inflight.server.launch import serve_model

MODEL = "tiny"
GREEDY = dict(temperature=0, max_output_tokens=10, extra_body={"ignore_eos": True})
HISTORY = [{"role": "user", "content": "what is 12+34?"}, {"role": "assistant", "content": "46"},
           {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "and 1+1?"}]}]
FUNCTIONS = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "Weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
    {
        "type": "function",
        "name": "get_time",
        "description": "Time in a zone.",
        "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}},
    },
]


@pytest.fixture(scope="module")
def client(server) -> OpenAI:
    return OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


def chat_answer(client: OpenAI, messages: list[dict], **extra) -> tuple[str, object]:
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0,
                                       extra_body={"ignore_eos": True, "return_token_ids": True}, **extra)
    return r.choices[0].message.content, r


def test_text_input_equals_chat(client):
    r = client.responses.create(model=MODEL, input="the sound of water", **GREEDY)
    text, chat = chat_answer(client, [{"role": "user", "content": "the sound of water"}])
    assert r.output_text == text and r.object == "response" and r.id.startswith("resp_")
    assert (r.status, r.incomplete_details.reason) == ("incomplete", "max_output_tokens")
    assert [item.type for item in r.output] == ["message"] and r.output[0].role == "assistant"
    assert (r.usage.input_tokens, r.usage.output_tokens) == (chat.usage.prompt_tokens, 10)
    assert r.usage.total_tokens == r.usage.input_tokens + 10


def test_message_list_with_instructions_equals_chat(client):
    r = client.responses.create(model=MODEL, input=HISTORY, instructions="be brief", **GREEDY)
    messages = [
        {"role": "system", "content": "be brief"},
        *HISTORY[:2],
        {"role": "user", "content": "and 1+1?"},
    ]
    assert r.output_text == chat_answer(client, messages)[0]
    assert r.instructions == "be brief" and r.max_output_tokens == 10


def test_streamed_events_equal_the_whole_response(client):
    whole = client.responses.create(model=MODEL, input=HISTORY, **GREEDY)
    events = list(client.responses.create(model=MODEL, input=HISTORY, stream=True, **GREEDY))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]  # as vLLM sends it; the response inside says incomplete
    assert events[-1].response.status == "incomplete"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    assert (
        events[-1].response.output_text == whole.output_text
        and events[-1].response.id == events[0].response.id
    )
    with client.responses.stream(model=MODEL, input=HISTORY, **GREEDY) as stream:
        texts = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(texts) == final.output_text == whole.output_text


def test_logprobs_equal_the_chat_routes(client):
    r = client.responses.create(model=MODEL, input="the water", include=["message.output_text.logprobs"],
                                top_logprobs=2, **GREEDY)
    _, chat = chat_answer(client, [{"role": "user", "content": "the water"}], logprobs=True, top_logprobs=2)
    mine = r.output[0].content[0].logprobs
    theirs = chat.choices[0].logprobs.content
    assert [(x.token, x.bytes, len(x.top_logprobs)) for x in mine] == [(x.token, x.bytes, 2) for x in theirs]
    # one prefix-cache hit
    assert [x.logprob for x in mine] == pytest.approx([x.logprob for x in theirs], abs=1e-5)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"background": True}, "background"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input[0].content[0]",
        ),  # a text-only model (test_server_images: a vision-language one)
        (
            {"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "x"}]}]},
            "input[0].content[0].type",
        ),
        ({"include": ["reasoning.encrypted_content"]}, "include"),
        ({"text": {"format": {"type": "json_object"}}}, "text"),
        ({"reasoning": {"effort": "high"}}, "reasoning"),
        ({"truncation": "auto"}, "truncation"),
        ({"tool_choice": "required", "tools": FUNCTIONS}, "tool_choice"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"input": []}, "input"),
        ({"presence_penalty": 1.0}, "presence_penalty"),
        ({"frobnicate": 1}, "frobnicate"),
        ({"model": "other"}, "model"),
    ],
)
def test_unsupported_is_a_400_naming_the_field(server, body, param):
    sent = {"model": MODEL, "input": "hi", **body}
    r = httpx.post(f"{server.url}/v1/responses", json=sent, timeout=30)
    assert r.status_code in (400, 404), r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"], error


@pytest.fixture(scope="module")
def tool_client(tmp_path_factory):
    path = tmp_path_factory.mktemp("responses-tool-model")
    make_tool_model(path)
    srv = serve_model(EngineConfig(model=str(path), block_size=16), "tools")
    yield OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=60), path
    srv.stop()


def test_function_tool_round_trip(tool_client):
    client, path = tool_client
    ask = [{"role": "user", "content": "weather in Paris, and the time?"}]
    r = client.responses.create(model="tools", input=ask, tools=FUNCTIONS, temperature=0)
    assert r.status == "completed"
    assert [item.type for item in r.output] == ["message", "function_call", "function_call"]
    assert r.output[0].content[0].text == CONTENT
    calls = r.output[1:]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [(WEATHER["name"], WEATHER["arguments"]),
                                                                   (TIME["name"], TIME["arguments"])]
    outputs = [{"type": "function_call_output", "call_id": c.call_id, "output": answer}
               for c, answer in zip(calls, ["sunny, 21 C", "14:05"], strict=True)]
    follow = [*ask, *[item.model_dump(exclude_none=True) for item in r.output], *outputs]
    again = client.responses.create(
        model="tools", input=follow, tools=FUNCTIONS, temperature=0, max_output_tokens=3
    )
    # the prompt the server rendered is the chat template's for the same conversation
    tokenizer = AutoTokenizer.from_pretrained(path)
    chat_tools = [
        {"type": "function", "function": {k: v for k, v in f.items() if k != "type"}} for f in FUNCTIONS
    ]
    conversation = [
        *ask,
        {
            "role": "assistant",
            "content": CONTENT,
            "tool_calls": [
                {
                    "id": c.call_id,
                    "type": "function",
                    "function": {"name": c.name, "arguments": json.loads(c.arguments)},
                }
                for c in calls
            ],
        },
        {"role": "tool", "tool_call_id": calls[0].call_id, "content": "sunny, 21 C"},
        {"role": "tool", "tool_call_id": calls[1].call_id, "content": "14:05"},
    ]
    ids = tokenizer.apply_chat_template(
        conversation, tools=chat_tools, add_generation_prompt=True
    )["input_ids"]
    assert again.usage.input_tokens == len(ids)
    rendered = httpx.post(str(client.base_url).replace("/v1/", "/tokenize"), json={
        "messages": conversation, "tools": chat_tools}).json()["tokens"]
    assert rendered == list(ids)
    streamed = list(
        client.responses.create(model="tools", input=ask, tools=FUNCTIONS, temperature=0, stream=True)
    )
    done = [e.item for e in streamed if e.type == "response.output_item.done"]
    assert [(i.type, getattr(i, "name", None)) for i in done] == [
        ("message", None),
        ("function_call", "get_weather"),
        ("function_call", "get_time"),
    ]
    deltas = [e for e in streamed if e.type == "response.function_call_arguments.delta"]
    assert [json.loads(e.delta) for e in deltas] == [WEATHER["arguments"], TIME["arguments"]]
    assert streamed[-1].type == "response.completed"
    assert [i.type for i in streamed[-1].response.output] == ["message", "function_call", "function_call"]
    with client.responses.stream(model="tools", input=ask, tools=FUNCTIONS, temperature=0) as stream:
        final = stream.get_final_response()
    assert [(c.name, c.arguments) for c in final.output[1:]] == [(c.name, c.arguments) for c in calls]


def test_refused_through_the_client(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model=MODEL, input="hi", previous_response_id="resp_123")
    assert err.value.body["param"] == "previous_response_id"
