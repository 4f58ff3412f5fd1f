"""Top-k logprobs through the official `openai` client and the token route, against transformers:
the k alternatives of each output token are the top-k of torch.log_softmax(logits / T) of the HF
model run on the same prompt and output. The engine is asked for logprobs only when the OpenAI
request asks for them; the token route always returns them (the trainer relies on it)."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import torch
from openai import OpenAI

from inflight.client import RemoteClient
from inflight.engine import SamplingParams

MODEL_NAME = "tiny"


@pytest.fixture(scope="module")
def client(server) -> OpenAI:
    return OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


def hf_top(hf, prompt: list[int], output: list[int], k: int, temperature: float) -> torch.return_types.topk:
    """transformers' top-k of the temperature-scaled log-probabilities at every output position."""
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + output])).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits / temperature, dim=-1).topk(k)


def token_id(name: str) -> int:
    assert name.startswith("token_id:"), name
    return int(name.removeprefix("token_id:"))


@pytest.mark.parametrize("stream", [False, True])
def test_chat_top_logprobs_match_transformers(client, model_dir, hf_model_factory, stream):
    """Sampled at T=0.7 with a seed: 3 alternatives per token, the temperature-scaled top-3."""
    kwargs = dict(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "what is 12+34?"}],
        max_tokens=10,
        temperature=0.7,
        seed=5,
        logprobs=True,
        top_logprobs=3,
        extra_body={"ignore_eos": True, "return_token_ids": True, "return_tokens_as_token_ids": True},
    )
    if stream:
        chunks = [c for c in client.chat.completions.create(stream=True, **kwargs) if c.choices]
        content = [e for c in chunks if c.choices[0].logprobs for e in c.choices[0].logprobs.content]
        prompt = client.chat.completions.create(**{**kwargs, "max_tokens": 1}).model_extra["prompt_token_ids"]
    else:
        r = client.chat.completions.create(**kwargs)
        content, prompt = r.choices[0].logprobs.content, r.model_extra["prompt_token_ids"]
    output = [token_id(e.token) for e in content]
    assert len(output) == 10
    want = hf_top(hf_model_factory(model_dir), prompt, output, 3, 0.7)
    for step, entry in enumerate(content):
        assert [token_id(t.token) for t in entry.top_logprobs] == want.indices[step].tolist()
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(want.values[step].tolist(), abs=1e-4)
        sampled = dict((token_id(t.token), t.logprob) for t in entry.top_logprobs).get(output[step])
        assert sampled is None or sampled == entry.logprob  # the same number, bit for bit


def test_completion_logprobs_k_are_the_top_k_plus_the_sampled_token(client, model_dir, hf_model_factory,
                                                                    tokenizer):
    prompt = tokenizer("the water is")["input_ids"]
    r = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=8, temperature=1.0, seed=3,
                                  logprobs=2, extra_body={"ignore_eos": True, "return_token_ids": True,
                                                          "return_tokens_as_token_ids": True})
    choice = r.choices[0]
    output = choice.model_extra["token_ids"]
    want = hf_top(hf_model_factory(model_dir), prompt, output, 2, 1.0)
    for step, top in enumerate(choice.logprobs.top_logprobs):
        ids = want.indices[step].tolist()
        expected = {f"token_id:{t}": v for t, v in zip(ids, want.values[step].tolist(), strict=True)}
        if output[step] not in ids:  # OpenAI: "up to logprobs + 1 elements"
            expected[f"token_id:{output[step]}"] = choice.logprobs.token_logprobs[step]
        assert top.keys() == expected.keys()
        assert list(top.values()) == pytest.approx(list(expected.values()), abs=1e-4)


def test_token_route_and_remote_client_carry_top_logprobs(server, reference):
    prompt = [7, 8, 9, 10, 11]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, top_logprobs=4)
    expected = reference.generate([prompt], params)[0]
    body = {"prompt_token_ids": prompt, "sampling_params": {"max_tokens": 6, "temperature": 0.0,
                                                            "ignore_eos": True, "top_logprobs": 4}}
    out = httpx.post(f"{server.url}/inflight/v1/generate", json=body, timeout=60).json()
    assert [[t for t, _ in step] for step in out["top_logprobs"]] == [
        [t for t, _ in s] for s in expected.top_logprobs
    ]

    async def remote():
        async with RemoteClient(server.url, retries=0) as rc:
            return await rc.generate(prompt, params)

    got = asyncio.run(remote())
    assert [[t for t, _ in step] for step in got.top_logprobs] == [
        [t for t, _ in s] for s in expected.top_logprobs
    ]
    for mine, theirs in zip(got.top_logprobs, expected.top_logprobs, strict=True):
        assert [lp for _, lp in mine] == pytest.approx([lp for _, lp in theirs], abs=1e-4)
    assert all(isinstance(t, int) and isinstance(lp, float) for step in got.top_logprobs for t, lp in step)



CHAT_BODY = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "n": 2}
ASKED = [  # route, body, (logprobs, top_logprobs) the engine is asked for
    ("/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 2, "n": 2}, (False, 0)),
    ("/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 2, "n": 2, "logprobs": 0}, (True, 0)),
    ("/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 2, "n": 2, "logprobs": 2}, (True, 2)),
    ("/v1/chat/completions", CHAT_BODY, (False, 0)),
    ("/v1/chat/completions", {**CHAT_BODY, "logprobs": True}, (True, 0)),
    ("/v1/chat/completions", {**CHAT_BODY, "logprobs": True, "top_logprobs": 3}, (True, 3)),
]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(("route", "body", "asked"), ASKED, ids=[f"{r}-{a}" for r, _, a in ASKED])
def test_the_engine_computes_logprobs_only_when_the_request_asks(
    server, monkeypatch, route, body, asked, stream
):
    seen = spy_on_params(server.engine, monkeypatch)
    r = httpx.post(f"{server.url}{route}", json={**body, "stream": stream}, timeout=60)
    assert r.status_code == 200, r.text
    assert [(p.logprobs, p.top_logprobs) for p in seen] == [asked, asked]
    if not stream:
        assert [c["logprobs"] is None for c in r.json()["choices"]] == [not asked[0]] * 2


def test_the_token_route_always_returns_logprobs(server, monkeypatch):
    seen = spy_on_params(server.engine, monkeypatch)
    body = {"prompt_token_ids": [5, 6, 7], "sampling_params": {"max_tokens": 2}}
    out = httpx.post(f"{server.url}/inflight/v1/generate", json=body, timeout=60).json()
    assert [p.logprobs for p in seen] == [True] and len(out["logprobs"]) == 2


def spy_on_params(engine, monkeypatch) -> list[SamplingParams]:
    """The SamplingParams of every request the server hands to `engine` from now on."""
    seen: list[SamplingParams] = []
    for method in ("generate", "generate_stream"):
        original = getattr(engine, method)

        def spy(prompt, params, *args, _original=original, **kwargs):
            seen.append(params)
            return _original(prompt, params, *args, **kwargs)

        monkeypatch.setattr(engine, method, spy)
    return seen
