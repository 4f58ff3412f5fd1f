"""The official `openai` package against a live server: completions, chat, streaming, logprobs and
stop strings, each equal to what the engine itself generates with the same parameters."""

from __future__ import annotations

import httpx
import pytest
from openai import OpenAI
from stop_strings import STOP_CASE, greedy_text_and_a_stop_string

from inflight.engine import LLMEngine, RequestOutput, SamplingParams

MAX_TOKENS = 12
MODEL_NAME = "tiny"  # as served by the conftest fixture


@pytest.fixture(scope="module")
def client(server) -> OpenAI:
    return OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


def engine_output(reference: LLMEngine, prompt: list[int], **params) -> RequestOutput:
    return reference.generate([prompt], SamplingParams(**params))[0]


def chat_ids(tokenizer, messages) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_models_lists_the_served_model(client):
    assert [m.id for m in client.models.list()] == [MODEL_NAME]


def test_completion_text_prompt_equals_engine(client, reference, tokenizer):
    prompt = "the water is"
    ids = tokenizer(prompt)["input_ids"]
    expected = engine_output(reference, ids, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    r = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                  logprobs=1, extra_body={"ignore_eos": True, "return_token_ids": True})
    choice = r.choices[0]
    assert choice.model_extra["token_ids"] == expected.output_token_ids
    assert choice.text == tokenizer.decode(expected.output_token_ids, skip_special_tokens=True)
    assert choice.logprobs.token_logprobs == pytest.approx(expected.logprobs, abs=1e-4)
    assert len(choice.logprobs.tokens) == MAX_TOKENS and len(choice.logprobs.top_logprobs) == MAX_TOKENS
    assert choice.finish_reason == "length"
    assert choice.model_extra["token_weight_versions"] == [0] * MAX_TOKENS
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), MAX_TOKENS)


def test_completion_token_prompts_batch_and_seeded_n(client, reference, tokenizer):
    prompts = [[5, 6, 7, 8, 9], [100, 101, 102]]
    r = client.completions.create(model=MODEL_NAME, prompt=prompts, n=2, max_tokens=8, temperature=0.9,
                                  seed=11, extra_body={"return_token_ids": True, "top_k": 50})
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    for choice in r.choices:
        prompt, k = prompts[choice.index // 2], choice.index % 2
        expected = engine_output(reference, prompt, max_tokens=8, temperature=0.9, top_k=50, seed=11 + k)
        assert choice.model_extra["token_ids"] == expected.output_token_ids
        assert choice.finish_reason == expected.finish_reason
        assert choice.text == tokenizer.decode(expected.output_token_ids, skip_special_tokens=True)
    assert r.choices[0].model_extra["token_ids"] != r.choices[1].model_extra["token_ids"]  # different seeds
    assert r.usage.prompt_tokens == 8


def test_chat_equals_engine_with_logprobs(client, reference, tokenizer):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what is 12+34?"}]
    ids = chat_ids(tokenizer, messages)
    expected = engine_output(reference, ids, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    r = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=MAX_TOKENS,
                                       temperature=0, logprobs=True, top_logprobs=1,
                                       extra_body={"ignore_eos": True, "return_token_ids": True})
    choice = r.choices[0]
    assert r.model_extra["prompt_token_ids"] == ids
    assert choice.model_extra["token_ids"] == expected.output_token_ids
    assert choice.message.role == "assistant"
    assert choice.message.content == tokenizer.decode(expected.output_token_ids, skip_special_tokens=True)
    content = choice.logprobs.content
    assert [c.logprob for c in content] == pytest.approx(expected.logprobs, abs=1e-4)
    assert all(len(c.top_logprobs) == 1 and c.top_logprobs[0].logprob == c.logprob for c in content)
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == MAX_TOKENS


def test_chat_streaming_equals_non_streaming(client):
    kwargs = dict(model=MODEL_NAME, messages=[{"role": "user", "content": "the sound of water"}],
                  max_tokens=20, temperature=0, extra_body={"ignore_eos": True, "return_token_ids": True})
    full = client.chat.completions.create(**kwargs)
    chunks = list(
        client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs)
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    tokens = [t for c in chunks if c.choices for t in (c.choices[0].model_extra or {}).get("token_ids", [])]
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert text == full.choices[0].message.content
    assert tokens == full.choices[0].model_extra["token_ids"]
    assert finish == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    assert len([c for c in chunks if c.choices]) >= 10  # it really streamed, chunk by chunk


def test_completion_streaming_with_logprobs(client):
    kwargs = dict(model=MODEL_NAME, prompt="12+34=", max_tokens=16, temperature=0, logprobs=0,
                  extra_body={"ignore_eos": True})
    full = client.completions.create(**kwargs)
    chunks = list(client.completions.create(stream=True, **kwargs))
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text
    streamed = [lp for c in chunks for lp in c.choices[0].logprobs.token_logprobs]
    assert streamed == pytest.approx(full.choices[0].logprobs.token_logprobs, abs=1e-4)
    assert chunks[-1].choices[0].finish_reason == "length"


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_cuts_the_text(client, stream):
    kwargs = STOP_CASE
    full, stop = greedy_text_and_a_stop_string(client)
    expected = full[: full.find(stop)]
    if stream:
        chunks = list(client.completions.create(stop=[stop], stream=True, **kwargs))
        text = "".join(c.choices[0].text for c in chunks)
        finish = chunks[-1].choices[0].finish_reason
    else:
        choice = client.completions.create(stop=stop, **kwargs).choices[0]
        text, finish = choice.text, choice.finish_reason
    assert (text, finish) == (expected, "stop")


def test_stop_string_that_never_matches_changes_nothing(client):
    kwargs = dict(model=MODEL_NAME, prompt="make a good day", max_tokens=24, temperature=0,
                  extra_body={"ignore_eos": True})
    full = client.completions.create(**kwargs).choices[0]
    stopped = client.completions.create(stop=["\u2603 never \u2603"], **kwargs).choices[0]
    streamed = list(client.completions.create(stop=["\u2603 never \u2603"], stream=True, **kwargs))
    assert (stopped.text, stopped.finish_reason) == (full.text, "length")
    assert "".join(c.choices[0].text for c in streamed) == full.text


def test_prefix_cache_hits_and_cache_salt(client):
    prompt = list(range(20, 60))  # ten blocks of 4
    kwargs = dict(model=MODEL_NAME, prompt=prompt, max_tokens=2, temperature=0)
    client.completions.create(**kwargs)
    again = client.completions.create(**kwargs)
    salted = client.completions.create(extra_body={"cache_salt": "tenant-b"}, **kwargs)
    assert again.usage.prompt_tokens_details.cached_tokens >= 36
    assert salted.usage.prompt_tokens_details.cached_tokens == 0


def test_generate_route_returns_tokens_logprobs_versions(server, reference):
    prompt = [7, 8, 9, 10, 11]
    expected = engine_output(reference, prompt, max_tokens=10, temperature=0.0, ignore_eos=True)
    body = {"prompt_token_ids": prompt, "request_id": "gen-1",
            "sampling_params": {"max_tokens": 10, "temperature": 0.0, "ignore_eos": True}}
    r = httpx.post(f"{server.url}/inflight/v1/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["request_id"] == "gen-1"
    assert out["output_token_ids"] == expected.output_token_ids
    assert out["logprobs"] == pytest.approx(expected.logprobs, abs=1e-4)
    assert out["token_weight_versions"] == [0] * 10 and out["weight_version"] == 0
    assert out["finish_reason"] == "length"
