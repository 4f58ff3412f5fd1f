"""`echo` and `prompt_logprobs` scored by the served engine equal transformers' log_softmax of the
prompt's logits (fp32, 1e-5); vLLM's `return_token_ids` / `stop_reason` placement, whole and streamed;
chat logprob `bytes` that rebuild the text."""

from __future__ import annotations

import json

import httpx
import pytest
import torch
from stop_strings import STOP_CASE, greedy_text_and_a_stop_string

from inflight.engine import RequestOutput, SamplingParams
from inflight.server.detokenize import Delta
from inflight.server.logprobs import TokenNamer, chat_logprobs

MODEL = "tiny"
ATOL = 1e-5


@pytest.fixture(scope="module")
def hf(model_dir, hf_model_factory):
    return hf_model_factory(model_dir)


def hf_logprobs(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0, :-1].float(), -1)


def hf_prompt_scores(hf, ids: list[int]) -> list[float]:
    return hf_logprobs(hf, ids).gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1).tolist()


def sse(r: httpx.Response) -> list[dict]:
    lines = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_echo_logprobs_as_lm_eval_sends_them(client, tokenizer, hf, reference):
    """echo=True, logprobs=1, max_tokens=1, temperature=0 on a text prompt and on a token prompt."""
    text = "the sound of water is a long way"
    ids = tokenizer(text)["input_ids"]
    for prompt in (text, ids):
        r = client.completions.create(model=MODEL, prompt=prompt, echo=True, logprobs=1, max_tokens=1,
                                      temperature=0, seed=1234)
        choice = r.choices[0]
        lp = choice.logprobs
        assert choice.text.startswith(text if isinstance(prompt, str) else tokenizer.decode(ids))
        assert len(lp.tokens) == len(ids) + 1 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert lp.token_logprobs[1:-1] == pytest.approx(hf_prompt_scores(hf, ids), abs=ATOL)
        sampled = reference.generate([ids], SamplingParams(max_tokens=1, temperature=0))[0]
        assert lp.token_logprobs[-1] == pytest.approx(sampled.logprobs[0], abs=1e-4)
        rows = hf_logprobs(hf, ids)
        for pos, top in enumerate(lp.top_logprobs[1:-1]):  # the most likely and the prompt token itself
            best = int(rows[pos].argmax())
            assert top[tokenizer.decode([best])] == pytest.approx(float(rows[pos, best]), abs=ATOL)
            assert lp.tokens[pos + 1] in top and 1 <= len(top) <= 2
        assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
        # vLLM's copy, set since echo scored the prompt
        assert choice.model_extra["prompt_logprobs"][0] is None
        assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), 1)


def test_echo_with_max_tokens_0_is_the_prompt_alone(client, tokenizer, hf):
    ids = tokenizer("make a good day")["input_ids"]
    r = client.completions.create(model=MODEL, prompt=ids, echo=True, logprobs=0, max_tokens=0,
                                  extra_body={"return_token_ids": True})
    choice = r.choices[0]
    assert choice.text == tokenizer.decode(ids) and choice.finish_reason == "length"
    assert choice.logprobs.token_logprobs[1:] == pytest.approx(hf_prompt_scores(hf, ids), abs=ATOL)
    assert len(choice.logprobs.tokens) == len(ids)
    assert choice.model_extra["token_ids"] == [] and choice.model_extra["prompt_token_ids"] == ids
    assert r.usage.completion_tokens == 0


def test_prompt_logprobs_in_vllm_shape(http, tokenizer, hf):
    """Completions: per choice; chat: at the top; {token_id: {logprob, rank, decoded_token}}."""
    ids = tokenizer("what is 12+34? it is a number")["input_ids"]
    r = http.post("/v1/completions", json={"prompt": ids, "max_tokens": 2, "prompt_logprobs": 3, "n": 2})
    rows = hf_logprobs(hf, ids)
    for choice in r.json()["choices"]:
        scores = choice["prompt_logprobs"]
        assert scores[0] is None and len(scores) == len(ids)
        for pos, (token, entry) in enumerate(zip(ids[1:], scores[1:], strict=True)):
            top3 = torch.topk(rows[pos], 3)
            expected = {int(token), *top3.indices.tolist()}
            assert {int(k) for k in entry} == expected
            assert entry[str(token)]["logprob"] == pytest.approx(float(rows[pos, token]), abs=ATOL)
            assert entry[str(token)]["rank"] == int((rows[pos] > rows[pos, token]).sum()) + 1
            best = str(int(top3.indices[0]))
            assert entry[best]["rank"] == 1 and entry[best]["decoded_token"] == tokenizer.decode([int(best)])
        assert choice["logprobs"] is None
    messages = [{"role": "user", "content": "the water"}]
    chat = http.post(
        "/v1/chat/completions",
        json={"messages": messages, "max_tokens": 2, "prompt_logprobs": 0, "return_token_ids": True},
    ).json()
    prompt = chat["prompt_token_ids"]
    assert [e and e[str(t)]["logprob"] for e, t in zip(chat["prompt_logprobs"], prompt, strict=True)][1:] == \
        pytest.approx(hf_prompt_scores(hf, prompt), abs=ATOL)
    assert all(e is None or len(e) == 1 for e in chat["prompt_logprobs"])


def test_streamed_echo_first_chunk_carries_the_prompt(http, tokenizer, hf):
    ids = tokenizer("the sound of water")["input_ids"]
    body = {"prompt": ids, "echo": True, "logprobs": 1, "max_tokens": 4, "temperature": 0, "stream": True,
            "return_token_ids": True, "ignore_eos": True}
    chunks = sse(http.post("/v1/completions", json=body))
    whole = http.post("/v1/completions", json={**body, "stream": False}).json()["choices"][0]
    first = chunks[0]["choices"][0]
    assert first["prompt_token_ids"] == ids
    assert first["logprobs"]["token_logprobs"][0] is None
    assert first["logprobs"]["token_logprobs"][1 : len(ids)] == pytest.approx(
        hf_prompt_scores(hf, ids), abs=ATOL
    )
    assert all("prompt_token_ids" not in c["choices"][0] for c in chunks[1:])
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["text"]
    assert sum((c["choices"][0]["token_ids"] for c in chunks), []) == whole["token_ids"]
    tokens = sum((c["choices"][0]["logprobs"]["tokens"] for c in chunks), [])
    assert tokens == whole["logprobs"]["tokens"]
    assert "stop_reason" in chunks[-1]["choices"][0] and "stop_reason" not in first


def test_return_token_ids_where_vllm_puts_them(http):
    """Completions: prompt_token_ids per choice (streamed: its first chunk); chat: at the top
    (streamed: the opening chunk); token_ids per choice; stop_reason in whole choices and last chunks."""
    prompt = [5, 6, 7, 8]
    body = {"prompt": prompt, "max_tokens": 3, "n": 2, "temperature": 0, "return_token_ids": True}
    whole = http.post("/v1/completions", json=body).json()
    assert [c["prompt_token_ids"] for c in whole["choices"]] == [prompt, prompt]
    assert all(len(c["token_ids"]) == 3 and c["stop_reason"] is None for c in whole["choices"])
    chunks = sse(http.post("/v1/completions", json={**body, "stream": True}))
    for index in (0, 1):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == index]
        assert mine[0]["prompt_token_ids"] == prompt and all("prompt_token_ids" not in c for c in mine[1:])
        assert sum((c["token_ids"] for c in mine), []) == whole["choices"][index]["token_ids"]
    messages = [{"role": "user", "content": "the water"}]
    chat = {"messages": messages, "max_tokens": 3, "temperature": 0, "return_token_ids": True}
    whole = http.post("/v1/chat/completions", json=chat).json()
    assert isinstance(whole["prompt_token_ids"], list) and "prompt_token_ids" not in whole["choices"][0]
    assert len(whole["choices"][0]["token_ids"]) == 3 and whole["choices"][0]["stop_reason"] is None
    chunks = sse(http.post("/v1/chat/completions", json={**chat, "stream": True}))
    assert chunks[0]["prompt_token_ids"] == whole["prompt_token_ids"]
    assert all("prompt_token_ids" not in c for c in chunks[1:])
    assert sum((c["choices"][0].get("token_ids", []) for c in chunks), []) == whole["choices"][0]["token_ids"]


def test_stop_reason_names_the_stop_string_or_token(client, http, reference, tokenizer):
    _, stop = greedy_text_and_a_stop_string(client)
    r = client.completions.create(**STOP_CASE, stop=[stop])
    assert r.choices[0].model_extra["stop_reason"] == stop
    ids = tokenizer(STOP_CASE["prompt"])["input_ids"]
    out = reference.generate([ids], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]
    token = next(
        t for i, t in enumerate(out.output_token_ids) if i >= 2 and t not in out.output_token_ids[:i]
    )
    for stream in (False, True):
        body = {
            "prompt": ids,
            "max_tokens": 8,
            "temperature": 0,
            "ignore_eos": True,
            "stop_token_ids": [token],
            "stream": stream,
        }
        r = http.post("/v1/completions", json=body)
        last = sse(r)[-1]["choices"][0] if stream else r.json()["choices"][0]
        assert (last["finish_reason"], last["stop_reason"]) == ("stop", token)


def test_chat_logprob_bytes_rebuild_multibyte_text(tokenizer):
    """Byte-level BPE splits these characters across tokens; each token's `bytes` are its own."""
    text = "h\u00e9llo \U0001f389 \u4e2d\u6587 \u2603 <|im_end|> ok"
    ids = tokenizer(text)["input_ids"]
    assert any("\ufffd" in tokenizer.decode([t]) for t in ids)  # some tokens hold part of a character
    delta = Delta(0, text, ids, [-1.0] * len(ids), [0] * len(ids), None, [[(t, -1.0)] for t in ids])
    content = chat_logprobs(TokenNamer(tokenizer, as_ids=False), delta, 1)["content"]
    assert b"".join(bytes(c["bytes"]) for c in content).decode() == text
    assert b"".join(bytes(c["top_logprobs"][0]["bytes"]) for c in content).decode() == text


def test_chat_logprob_bytes_over_http_join_to_the_content(client):
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "\u4e2d\u6587 \U0001f389"}],
        max_tokens=12,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    content = r.choices[0].logprobs.content
    assert (
        b"".join(bytes(c.bytes) for c in content).decode("utf-8", "replace") == r.choices[0].message.content
    )


def test_engine_output_carries_no_prompt_scores_unless_asked(reference):
    out: RequestOutput = reference.generate([[5, 6, 7]], SamplingParams(max_tokens=1))[0]
    assert out.prompt_logprobs is None and out.prompt_logprob_ranks is None


def test_token_route_prompt_logprobs(http, hf):
    ids = [5, 17, 101, 33, 250, 7, 64]
    out = http.post("/inflight/v1/generate", json={"prompt_token_ids": ids, "sampling_params": {
        "max_tokens": 1, "temperature": 0.7, "prompt_logprobs": 2}}).json()
    rows = hf_logprobs(hf, ids)
    expected = rows.gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)
    assert out["prompt_logprobs"][0] is None and out["prompt_top_logprobs"][0] is None
    # T = 1 whatever the temperature
    assert out["prompt_logprobs"][1:] == pytest.approx(expected.tolist(), abs=ATOL)
    assert out["prompt_logprob_ranks"][1:] == ((rows > expected[:, None]).sum(-1) + 1).tolist()
    assert (
        [[t for t, _ in top] for top in out["prompt_top_logprobs"][1:]]
        == torch.topk(rows, 2).indices.tolist()
    )
    plain = http.post("/inflight/v1/generate", json={"prompt_token_ids": ids}).json()
    assert plain["prompt_logprobs"] is None and plain["prompt_top_logprobs"] is None
