"""Fields the engine does not implement are a 400 naming them (never ignored), their defaults and
harmless metadata are accepted, and the server keeps serving; through the official `openai` client
where it can send the field."""

from __future__ import annotations

import httpx
import openai
import pytest
from stop_strings import STOP_CASE, greedy_text_and_a_stop_string

from inflight.server.unsupported import REFUSED

MODEL_NAME = "tiny"
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MESSAGES = [{"role": "user", "content": "the sound of water"}]
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

REFUSED_VALUES = [
    ("presence_penalty", 0.5),
    ("frequency_penalty", -1.0),
    ("repetition_penalty", 1.2),
    ("min_p", 0.05),
    ("logit_bias", {"5": 10}),
    ("min_tokens", 4),
    ("use_beam_search", True),
    ("length_penalty", 0.5),
    ("allowed_token_ids", [5, 6]),
    ("bad_words", ["water"]),
    ("priority", 1),
    ("guided_json", {"type": "object"}),
    ("guided_choice", ["a", "b"]),
    ("structured_outputs", {"regex": "a"}),
    ("response_format", {"type": "json_object"}),
    ("truncate_prompt_tokens", 8),
    ("reasoning_effort", "low"),
    ("parallel_tool_calls", False),
    ("functions", [{"name": "f"}]),
    ("modalities", ["text", "audio"]),
    ("spaces_between_special_tokens", False),
    ("documents", [{"text": "x"}]),
    ("echo", True),
]
DEFAULTS = {
    "presence_penalty": 0,
    "frequency_penalty": 0.0,
    "logit_bias": {},
    "repetition_penalty": 1.0,
    "min_p": 0.0,
    "response_format": {"type": "text"},
    "parallel_tool_calls": True,
    "use_beam_search": False,
    "user": "alice",
    "metadata": {"run": "7"},
    "store": False,
    "service_tier": "auto",
    "seed": 1,
}


def assert_refused(r: httpx.Response, param: str, code: str = "unsupported_parameter") -> None:
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["param"], error["code"]) == (param, code) and param in error["message"]


@pytest.mark.parametrize(("field", "value"), REFUSED_VALUES, ids=[f for f, _ in REFUSED_VALUES])
def test_non_default_value_is_refused_by_name(http, field, value):
    assert field in REFUSED
    assert_refused(http.post(CHAT, json={"messages": MESSAGES, "max_tokens": 2, field: value}), field)
    if field not in (
        "parallel_tool_calls",
        "functions",
        "response_format",
        "documents",
        "reasoning_effort",
        "echo",
    ):
        assert_refused(http.post(COMPLETIONS, json={"prompt": "x", "max_tokens": 2, field: value}), field)


def test_defaults_and_metadata_are_accepted(http):
    for route, body in ((CHAT, {"messages": MESSAGES}), (COMPLETIONS, {"prompt": "the water"})):
        r = http.post(route, json={**body, "max_tokens": 2, **DEFAULTS})
        assert r.status_code == 200, r.text


def test_unrecognized_field_is_refused_and_the_server_keeps_serving(http, client):
    assert_refused(
        http.post(CHAT, json={"messages": MESSAGES, "temprature": 0}), "temprature", "unknown_parameter"
    )
    r = http.post(CHAT, json={"messages": MESSAGES, "stream": True,
                              "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    assert_refused(r, "stream_options.continuous_usage_stats", "invalid_value")
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model=MODEL_NAME, messages=MESSAGES, max_tokens=2, extra_body={"min_p": 0.1}
        )
    assert err.value.param == "min_p"
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=2, presence_penalty=0.3)
    assert err.value.param == "presence_penalty"
    r = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=3, temperature=0)
    assert r.choices[0].finish_reason in ("length", "stop") and r.usage.completion_tokens >= 1


def test_tools_on_a_template_that_ignores_them_are_refused(client, tokenizer):
    """A plain ChatML template (given with the `chat_template` extension) has no tools section: the
    tools would be dropped silently. The same template without tools serves normally."""
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=[tool], max_tokens=2,
                                       extra_body={"chat_template": CHATML})
    assert err.value.param == "tools" and "chat template" in err.value.message
    r = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=2,
                                       extra_body={"chat_template": CHATML, "return_token_ids": True})
    want = tokenizer.apply_chat_template(MESSAGES, chat_template=CHATML, add_generation_prompt=True)
    assert r.model_extra["prompt_token_ids"] == list(want["input_ids"])


def test_include_stop_str_in_output_keeps_the_stop_string(client):
    kwargs = STOP_CASE
    full, stop = greedy_text_and_a_stop_string(client)
    kept = client.completions.create(stop=[stop], **{**kwargs, "extra_body": {
        "ignore_eos": True, "include_stop_str_in_output": True}}).choices[0]
    assert (kept.text, kept.finish_reason) == (full[: full.find(stop) + len(stop)], "stop")
