"""`--backend vllm` answers what the native server answers (issue 30): started on a model whose
context (512) is shorter than the old fixed 2048 without `--max-model-len`; prompt logprobs (token
route, `echo`) equal transformers; `/tokenize`, `/detokenize`, `/tokenizer_info` equal the native
server's on the same model; `return_token_ids` / `stop_reason` / `prompt_logprobs` where vLLM puts
them are where the native server puts them; in vLLM's raw_logprobs mode, sampled logprobs with top_p
< 1 equal the native engine's; `models.retrieve` and `/v1/responses` (text, streamed,
function tools) through the official client."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest
import torch
from openai import OpenAI
from vllm_launch import TINY, launch, vllm_python_or_skip

from inflight.client import RemoteClient
from inflight.engine import EngineConfig, SamplingParams
from inflight.server.launch import serve_model

pytestmark = pytest.mark.vllm
NAME = "tiny"
CONTEXT = 512
# vLLM's CPU kernels against transformers, float32: another summation order over 4 layers of
# 512/1024-wide sums, ~2n eps relative per sum on logits of magnitude ~10 (test_vllm_server's TOL, T = 1)
ATOL = 1.5e-3
FUNCTION = {"type": "function", "name": "get_weather", "description": "Weather in a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}


@pytest.fixture(scope="module")
def model(tiny_model_factory):
    return tiny_model_factory("qwen2", 0, **TINY, max_position_embeddings=CONTEXT)


@pytest.fixture(scope="module")
def vllm_url(model):
    vllm_python_or_skip()
    with launch(model, ["--served-model-name", NAME, "--", "--logprobs-mode", "raw_logprobs"]) as (url, _):
        yield url


@pytest.fixture(scope="module")
def native_url(model):
    srv = serve_model(EngineConfig(model=str(model), block_size=16), NAME)
    yield srv.url
    srv.stop()


@pytest.fixture(scope="module")
def hf(model, hf_model_factory):
    return hf_model_factory(model)


def hf_logprobs(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0, :-1].float(), -1)


def post(url: str, route: str, body: dict) -> dict:
    r = httpx.post(url + route, json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def sse(url: str, route: str, body: dict) -> list[dict]:
    r = httpx.post(url + route, json={**body, "stream": True}, timeout=60)
    lines = [line[6:] for line in r.text.splitlines() if line.startswith("data: ") and line != "data: [DONE]"]
    return [json.loads(line) for line in lines]


def test_context_comes_from_the_models_config(vllm_url):
    models = httpx.get(vllm_url + "/v1/models", timeout=30).json()["data"]
    assert [(m["id"], m["max_model_len"]) for m in models] == [(NAME, CONTEXT)]


@pytest.mark.parametrize("max_tokens", [1, 40])
def test_prompt_logprobs_equal_transformers(vllm_url, hf, max_tokens):
    """Also past the first output: vLLM streams the prompt's scores with its first output only (40
    tokens reach the shim in two outputs, STREAM_INTERVAL 32), through RemoteClient too."""
    ids = [5, 17, 101, 33, 250, 7, 64, 300, 12]
    params = {
        "max_tokens": max_tokens,
        "temperature": 0.7,
        "prompt_logprobs": 2,
        "ignore_eos": True,
        "logprobs": False,
    }
    out = post(vllm_url, "/inflight/v1/generate", {"prompt_token_ids": ids, "sampling_params": params})
    rows = hf_logprobs(hf, ids)
    expected = rows.gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)
    assert len(out["output_token_ids"]) == max_tokens
    assert out["prompt_logprobs"][0] is None
    assert out["prompt_logprobs"][1:] == pytest.approx(expected.tolist(), abs=ATOL)  # no temperature
    assert out["prompt_logprob_ranks"][1:] == ((rows > expected[:, None]).sum(-1) + 1).tolist()
    top = torch.topk(rows, 2)
    assert [[t for t, _ in row] for row in out["prompt_top_logprobs"][1:]] == top.indices.tolist()
    got_top = [lp for row in out["prompt_top_logprobs"][1:] for _, lp in row]
    assert got_top == pytest.approx(top.values.flatten().tolist(), abs=ATOL)

    async def remote():
        async with RemoteClient(vllm_url, health_check_interval_s=None) as rc:
            return await rc.generate(ids, SamplingParams(**params, seed=1))

    got = asyncio.run(remote())
    assert got.prompt_logprobs[1:] == pytest.approx(expected.tolist(), abs=ATOL)
    assert got.prompt_logprob_ranks == out["prompt_logprob_ranks"]
    assert got.prompt_top_logprobs == [None if row is None else [tuple(p) for p in row]
                                       for row in out["prompt_top_logprobs"]]
    echo = post(
        vllm_url,
        "/v1/completions",
        {"prompt": ids, "echo": True, "logprobs": 1, "max_tokens": max_tokens, "temperature": 0},
    )["choices"][0]["logprobs"]
    assert echo["token_logprobs"][0] is None
    assert echo["token_logprobs"][1 : len(ids)] == pytest.approx(expected.tolist(), abs=ATOL)


def test_raw_logprobs_with_top_p_equal_the_native_engines(vllm_url, native_url, hf):
    """DAPO's sampling (temperature 1, top_p 0.7) on a server in vLLM's raw_logprobs mode (what a run
    whose sampling filters starts: `backends.vllm.run_checks.logprobs_mode`): each sampled token's
    logprob and top-3 are the unfiltered distribution's, as the native engine gives them (it scores
    vLLM's continuation here) and transformers; a temperature the mode cannot give is refused."""
    ids = [5, 17, 101, 33, 250, 7, 64, 300, 12]
    params = {
        "max_tokens": 24,
        "temperature": 1.0,
        "top_p": 0.7,
        "seed": 5,
        "top_logprobs": 3,
        "ignore_eos": True,
    }
    out = post(vllm_url, "/inflight/v1/generate", {"prompt_token_ids": ids, "sampling_params": params})
    tokens = out["output_token_ids"]
    scored = post(native_url, "/inflight/v1/generate", {"prompt_token_ids": ids + tokens, "sampling_params": {
        "max_tokens": 1, "temperature": 0.0, "prompt_logprobs": 3}})
    native = scored["prompt_logprobs"][len(ids):]
    assert out["logprobs"] == pytest.approx(native, abs=ATOL)
    native_top = scored["prompt_top_logprobs"][len(ids):]
    assert [[t for t, _ in row] for row in out["top_logprobs"]] == [[t for t, _ in row] for row in native_top]
    assert [lp for row in out["top_logprobs"] for _, lp in row] == pytest.approx(
        [lp for row in native_top for _, lp in row], abs=ATOL)
    rows = hf_logprobs(hf, ids + tokens)[len(ids) - 1:]
    assert out["logprobs"] == pytest.approx(
        rows.gather(1, torch.tensor(tokens)[:, None])[:, 0].tolist(), abs=ATOL
    )
    probs = rows.exp()  # sampled within the nucleus: less than top_p of the mass lies above each token
    assert all(probs[i][probs[i] > probs[i, t]].sum() < 0.7 + ATOL for i, t in enumerate(tokens))
    refused = httpx.post(
        vllm_url + "/inflight/v1/generate",
        json={"prompt_token_ids": ids, "sampling_params": {"max_tokens": 4, "temperature": 0.7}},
        timeout=60,
    )
    assert (
        refused.status_code == 400
        and "`--logprobs-mode processed_logprobs`" in refused.json()["error"]["message"]
    )


def test_tokenizer_routes_equal_the_native_servers(vllm_url, native_url):
    bodies = [("/tokenize", {"prompt": "the water is 12+34 \u2603", "return_token_strs": True}),
              ("/tokenize", {"prompt": "the water", "add_special_tokens": False}),
              ("/tokenize", {"messages": [{"role": "user", "content": "hi there"}]}),
              ("/detokenize", {"tokens": [366, 289, 316, 297, 223, 2]})]
    for route, body in bodies:
        assert post(vllm_url, route, body) == post(native_url, route, body), (route, body)
    mine, theirs = (httpx.get(u + "/tokenizer_info", timeout=30).json() for u in (native_url, vllm_url))
    for key in ("eos_token", "bos_token", "pad_token", "chat_template"):
        assert mine[key] == theirs[key], key


def _keys(obj: dict) -> set[str]:
    return {k for k, v in obj.items() if v is not None}


def test_token_ids_and_stop_reason_where_vllm_puts_them(vllm_url, native_url):
    """Every field the native server sets (at the top, in choices, in stream chunks) vLLM sets too,
    but our own `token_weight_versions`."""
    ours_only = {"token_weight_versions"}
    completion = {"model": NAME, "prompt": [5, 6, 7, 8], "max_tokens": 3, "temperature": 0.8, "seed": 3,
                  "return_token_ids": True, "n": 2, "logprobs": 1, "prompt_logprobs": 1}
    chat = {
        "model": NAME,
        "messages": [{"role": "user", "content": "the water"}],
        "max_tokens": 3,
        "temperature": 0,
        "return_token_ids": True,
        "logprobs": True,
    }
    for route, body in (("/v1/completions", completion), ("/v1/chat/completions", chat)):
        mine, theirs = post(native_url, route, body), post(vllm_url, route, body)
        legacy = {"prompt_token_ids"} if route == "/v1/completions" else set()  # our top-level copy, kept
        assert _keys(mine) - _keys(theirs) <= legacy, (route, _keys(mine) - _keys(theirs))
        for a, b in zip(mine["choices"], theirs["choices"], strict=True):
            assert _keys(a) - ours_only <= _keys(b) | {"stop_reason"}, (route, _keys(a) - _keys(b))
            assert (
                a.get("prompt_token_ids") == b.get("prompt_token_ids")
                and len(a["token_ids"]) == len(b["token_ids"])
            )
        streamed = {k: v for k, v in body.items() if k != "prompt_logprobs"}
        mine, theirs = sse(native_url, route, streamed), sse(vllm_url, route, streamed)
        assert [_keys(c) for c in mine if c["choices"]][0] <= [_keys(c) for c in theirs if c["choices"]][0]
        for index in range(body.get("n", 1)):
            a = [c["choices"][0] for c in mine if c["choices"] and c["choices"][0]["index"] == index]
            b = [c["choices"][0] for c in theirs if c["choices"] and c["choices"][0]["index"] == index]
            assert ("prompt_token_ids" in a[0]) == ("prompt_token_ids" in b[0]), route
            assert len(sum((c.get("token_ids") or [] for c in a), [])) == len(
                sum((c.get("token_ids") or [] for c in b), [])
            )
            assert "stop_reason" in a[-1] and "stop_reason" in b[-1]


def test_models_retrieve_and_responses_through_the_client(vllm_url):
    client = OpenAI(base_url=f"{vllm_url}/v1", api_key="unused", max_retries=0, timeout=120)
    assert client.models.retrieve(NAME).id == NAME
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("other")
    r = client.responses.create(model=NAME, input="the sound of water", max_output_tokens=5, temperature=0)
    assert r.status == "incomplete" and r.usage.output_tokens == 5
    events = list(client.responses.create(model=NAME, input="the sound of water", max_output_tokens=5,
                                          temperature=0, stream=True))
    assert events[-1].type == "response.completed" and events[-1].response.output_text == r.output_text
    with_tools = client.responses.create(model=NAME, input="weather in Paris?", tools=[FUNCTION],
                                         max_output_tokens=5, temperature=0)
    assert with_tools.usage.output_tokens == 5  # parsed by vLLM's Hermes parser, as ours: no call in 5 tokens


def test_max_tokens_against_the_context_as_vllm_answers(vllm_url, native_url):
    """vLLM 0.32's own answers are the reference: an output budget over the whole context is a 400 (the same
    message, naming the field the request used), one that overruns it only with the prompt is served to the
    end of the context, and a chat without max_tokens runs to the end of the context."""
    clients = [
        OpenAI(base_url=f"{u}/v1", api_key="unused", max_retries=0, timeout=120)
        for u in (native_url, vllm_url)
    ]
    prompt = [5 + i % 300 for i in range(500)]
    long_chat = [{"role": "user", "content": "the water " * 118}]  # ~490 tokens
    too_long = {
        "completion": lambda c: c.completions.create(model=NAME, prompt=prompt, max_tokens=CONTEXT + 1),
        "chat": lambda c: c.chat.completions.create(model=NAME, messages=long_chat, max_tokens=CONTEXT + 1),
        "chat, new name": lambda c: c.chat.completions.create(
            model=NAME, messages=long_chat, max_completion_tokens=600
        ),
        "responses": lambda c: c.responses.create(model=NAME, input="hi", max_output_tokens=CONTEXT + 1),
    }
    for what, call in too_long.items():
        errors = []
        for client in clients:
            with pytest.raises(openai.BadRequestError) as err:
                call(client)
            errors.append((err.value.body["message"], err.value.body["param"]))
        assert errors[0] == errors[1], what
    served = [c.completions.create(model=NAME, prompt=prompt, max_tokens=CONTEXT, temperature=0,
                                   extra_body={"ignore_eos": True}) for c in clients]
    assert (
        [(s.choices[0].finish_reason, s.usage.completion_tokens) for s in served]
        == [("length", CONTEXT - 500)] * 2
    )
    chats = [
        c.chat.completions.create(
            model=NAME, messages=long_chat, temperature=0, extra_body={"ignore_eos": True}
        )
        for c in clients
    ]
    counts = [(c.usage.prompt_tokens, c.usage.completion_tokens) for c in chats]
    assert counts[0] == counts[1]
    assert chats[0].usage.total_tokens == CONTEXT and chats[0].choices[0].finish_reason == "length"
