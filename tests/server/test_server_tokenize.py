"""`/tokenize`, `/detokenize`, `/tokenizer_info` (vLLM's shapes) and `GET /v1/models/{id}` (the
official openai client's `models.retrieve`), checked against the tokenizer and chat template."""

from __future__ import annotations

import openai
import pytest

MODEL = "tiny"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "add two numbers",
            "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}},
        },
    }
]


def test_models_retrieve(client, server):
    model = client.models.retrieve(MODEL)
    assert (model.id, model.object, model.owned_by) == (MODEL, "model", "inflight")
    with pytest.raises(openai.NotFoundError) as err:
        client.models.retrieve("other/model")
    assert err.value.body["code"] == "model_not_found" and err.value.body["param"] == "model"


def test_tokenize_prompt_and_token_strs(http, tokenizer):
    text = "the water is 12+34 \u2603"
    r = http.post("/tokenize", json={"model": MODEL, "prompt": text, "return_token_strs": True}).json()
    ids = tokenizer(text)["input_ids"]
    assert r == {"count": len(ids), "max_model_len": 1024, "tokens": ids,
                 "token_strs": tokenizer.convert_ids_to_tokens(ids)}
    assert http.post("/tokenize", json={"prompt": text}).json()["token_strs"] is None


def test_tokenize_messages_equals_the_chat_route(http, tokenizer):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "add 2 and 3"}]
    for extra in ({}, {"tools": TOOLS}, {"add_generation_prompt": False}):
        r = http.post("/tokenize", json={"messages": messages, **extra}).json()
        text = tokenizer.apply_chat_template(messages, tokenize=False, tools=extra.get("tools"),
                                             add_generation_prompt=extra.get("add_generation_prompt", True))
        assert r["tokens"] == tokenizer(text, add_special_tokens=False)["input_ids"]
        chat = http.post(
            "/v1/chat/completions",
            json={"messages": messages, "max_tokens": 1, "return_token_ids": True, **extra},
        ).json()
        assert chat["prompt_token_ids"] == r["tokens"]


def test_detokenize_round_trip_and_tokenizer_info(http, tokenizer):
    ids = tokenizer("h\u00e9llo <|im_end|> w\u00f6rld")["input_ids"]
    assert http.post("/detokenize", json={"tokens": ids}).json() == {"prompt": tokenizer.decode(ids)}
    info = http.get("/tokenizer_info").json()
    assert info["eos_token"] == tokenizer.eos_token and info["chat_template"] == tokenizer.chat_template
    assert info["tokenizer_class"] == type(tokenizer).__name__


@pytest.mark.parametrize(
    ("route", "body", "param"),
    [
        ("/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, "prompt"),
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": "x", "tools": TOOLS}, "tools"),
        ("/tokenize", {"messages": []}, "messages"),
        (
            "/tokenize",
            {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "web"}]},
            "tools[0].type",
        ),
        (
            "/tokenize",
            {"messages": [{"role": "user", "content": "x"}], "continue_final_message": True},
            "continue_final_message",
        ),
        ("/tokenize", {"prompt": "x", "model": "other"}, "model"),
        ("/tokenize", {"prompt": "x", "bogus": 1}, "bogus"),
        ("/detokenize", {"tokens": [5, 10**9]}, "tokens"),
        ("/detokenize", {"tokens": [-1]}, "tokens"),
        ("/detokenize", {"tokens": "abc"}, "tokens"),
    ],
)
def test_bad_input_is_an_openai_error_naming_the_field(http, route, body, param):
    r = http.post(route, json=body)
    assert r.status_code in (400, 404), r.text
    assert r.json()["error"]["param"] == param, r.json()
