"""Every bad input gets a 4xx with an OpenAI-style error body, and the server keeps serving; control
routes need their token and the OpenAI routes their API key."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from openai import OpenAI
from safetensors.torch import load_file

from inflight.client.wire import encode_tensors
from inflight.engine import EngineConfig
from inflight.server.launch import serve_model

API_KEY = "api-secret"
CONTROL = "control-secret"
MAX_BODY = 64 * 1024
CHAT = "/v1/chat/completions"
SLOW_TOKENIZE_S = 2.0
COMPLETIONS = "/v1/completions"


class ExplodingTokenizer:
    """The real tokenizer, except that encoding "boom!" raises: a stand-in for a bug in a route."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def __call__(self, text, *args, **kwargs):
        if text == "boom!":
            raise RuntimeError("tokenizer exploded")
        if text == "slow!":  # a 15 MB prompt takes this long
            time.sleep(SLOW_TOKENIZE_S)
        return self.inner(text, *args, **kwargs)


@pytest.fixture(scope="module")
def server(model_dir, tokenizer):
    srv = serve_model(EngineConfig(model=str(model_dir), block_size=4), "tiny", api_key=API_KEY,
                      control_token=CONTROL, max_body_bytes=MAX_BODY, tokenizer=ExplodingTokenizer(tokenizer))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60, headers={"Authorization": f"Bearer {API_KEY}"}) as c:
        yield c


def control(token: str = CONTROL) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def assert_error(response: httpx.Response, status: int, param: str | None = None, code: str | None = None):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert isinstance(error["type"], str)
    if param is not None:
        assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    return error


def assert_still_serving(http: httpx.Client) -> None:
    r = http.post(COMPLETIONS, json={"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200 and len(r.json()["choices"][0]["text"]) > 0
    assert http.get("/health").json()["status"] == "ok"


BAD_JSON = [
    pytest.param(b'{"model": "tiny", "prompt": ', "invalid_json", id="truncated-json"),
    pytest.param(b"not json at all", "invalid_json", id="not-json"),
    pytest.param(b"[1, 2, 3]", "invalid_json", id="json-array-body"),
]


@pytest.mark.parametrize(("body", "code"), BAD_JSON)
@pytest.mark.parametrize("route", [COMPLETIONS, CHAT, "/inflight/v1/generate"])
def test_malformed_json(http, route, body, code):
    assert_error(http.post(route, content=body, headers={"Content-Type": "application/json"}), 400, code=code)
    assert_still_serving(http)


BAD_REQUESTS = [
    # route, body, status, param, code
    (COMPLETIONS, {"model": "gpt-17", "prompt": "x"}, 404, "model", "model_not_found"),
    (
        CHAT,
        {"model": "gpt-17", "messages": [{"role": "user", "content": "x"}]},
        404,
        "model",
        "model_not_found",
    ),
    (COMPLETIONS, {"prompt": "x", "temperature": -1}, 400, "temperature", None),
    (COMPLETIONS, {"prompt": "x", "temperature": "hot"}, 400, "temperature", None),
    (COMPLETIONS, {"prompt": "x", "top_p": 0}, 400, "top_p", None),
    (COMPLETIONS, {"prompt": "x", "top_p": 1.5}, 400, "top_p", None),
    (COMPLETIONS, {"prompt": "x", "max_tokens": 0}, 400, "max_tokens", None),
    (COMPLETIONS, {"prompt": "x", "top_k": -5}, 400, "top_k", None),
    (COMPLETIONS, {"prompt": "x", "n": 0}, 400, "n", None),
    (COMPLETIONS, {"prompt": "x", "logprobs": 99}, 400, "logprobs", None),
    (COMPLETIONS, {"prompt": "x", "stop_token_ids": [-1]}, 400, "stop_token_ids", None),
    (
        COMPLETIONS,
        {"prompt": "x", "frequency_penalty": 0.5},
        400,
        "frequency_penalty",
        "unsupported_parameter",
    ),
    (COMPLETIONS, {"prompt": "x", "echo": True, "suffix": "y"}, 400, "suffix", "unsupported_parameter"),
    (COMPLETIONS, {"prompt": "x", "prompt_logprobs": 21}, 400, "prompt_logprobs", None),
    (COMPLETIONS, {"prompt": "x", "prompt_logprobs": -1}, 400, "prompt_logprobs", None),
    (COMPLETIONS, {"prompt": "x", "prompt_logprobs": 1, "stream": True}, 400, "prompt_logprobs", None),
    (
        CHAT,
        {"messages": [{"role": "user", "content": "x"}], "prompt_logprobs": 1, "stream": True},
        400,
        "prompt_logprobs",
        None,
    ),
    (
        CHAT,
        {"messages": [{"role": "user", "content": "x"}], "echo": True},
        400,
        "echo",
        "unsupported_parameter",
    ),
    (COMPLETIONS, {"prompt": "x", "stop": [""]}, 400, "stop", None),
    (COMPLETIONS, {"prompt": ""}, 400, "prompt", None),
    (COMPLETIONS, {"prompt": []}, 400, "prompt", None),
    (COMPLETIONS, {"prompt": [5, 999999]}, 400, "prompt", None),
    (COMPLETIONS, {}, 400, "prompt", None),
    (COMPLETIONS, {"prompt": [5] * 1100}, 400, "prompt", "context_length_exceeded"),
    (
        CHAT,
        {"messages": [{"role": "user", "content": "the " * 1100}]},
        400,
        "messages",
        "context_length_exceeded",
    ),
    (CHAT, {"messages": []}, 400, "messages", None),
    (CHAT, {"messages": "hello"}, 400, "messages", None),
    (CHAT, {"messages": [{"content": "no role"}]}, 400, "messages.0.role", None),
    (
        CHAT,
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        400,
        "messages[0].content[0]",
        "unsupported_content",
    ),  # a text-only model
    (
        CHAT,
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "audio"}]}]},
        400,
        "messages[0].content[1]",
        "unsupported_content",
    ),
    (CHAT, {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 3}, 400, "top_logprobs", None),
    (CHAT, {"messages": [{"role": "user", "content": "x"}], "temperature": -0.1}, 400, "temperature", None),
    (
        CHAT,
        {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
        400,
        "tools[0].function",
        "invalid_value",
    ),
    ("/inflight/v1/generate", {"prompt_token_ids": []}, 400, "prompt_token_ids", None),
    (
        "/inflight/v1/generate",
        {"prompt_token_ids": [1], "sampling_params": {"max_tokenz": 3}},
        400,
        "sampling_params.max_tokenz",
        None,
    ),
    (
        "/inflight/v1/generate",
        {"prompt_token_ids": [1], "sampling_params": {"temperature": -2}},
        400,
        "temperature",
        None,
    ),
    ("/inflight/v1/generate", {"prompt_token_ids": [1, 2.5]}, 400, "prompt_token_ids.1", None),
    # a lone surrogate is valid JSON but not Unicode: the tokenizer raised TypeError (a 500) before
    (COMPLETIONS, {"prompt": "a\ud800b"}, 400, "prompt", "invalid_value"),
    (COMPLETIONS, {"prompt": ["ok", "\udfff"]}, 400, "prompt", "invalid_value"),
    (CHAT, {"messages": [{"role": "user", "content": "x\ud800"}]}, 400, "messages", "invalid_value"),
    (
        CHAT,
        {"messages": [{"role": "user", "content": "x"}], "stop": ["\ud800"]},
        400,
        "stop",
        "invalid_value",
    ),
    # a request's own chat template is code: refused unless the server trusts it (finding 8)
    (
        CHAT,
        {
            "messages": [{"role": "user", "content": "x"}],
            "chat_template": "{% for i in range(9) %}{% endfor %}",
        },
        400,
        "chat_template",
        "unsupported_parameter",
    ),
    (COMPLETIONS, {"prompt": ["a"] * 9, "n": 128, "max_tokens": 1}, 400, "prompt", "invalid_value"),
]


@pytest.mark.parametrize(("route", "body", "status", "param", "code"), BAD_REQUESTS,
                         ids=[f"{i}-{r[0].rsplit('/', 1)[-1]}-{r[3]}" for i, r in enumerate(BAD_REQUESTS)])
def test_bad_request_gets_openai_error(http, route, body, status, param, code):
    # json.dumps escapes non-ASCII (httpx's json= cannot encode a lone surrogate)
    sent = http.post(route, content=json.dumps(body), headers={"Content-Type": "application/json"})
    assert_error(sent, status, param, code)


def test_engine_has_nothing_left_over_after_bad_requests(http, server):
    assert_still_serving(http)
    assert not server.engine.engine.has_unfinished_requests()


def test_oversize_body_is_413(http):
    big = {"model": "tiny", "prompt": "x" * (MAX_BODY + 1)}
    assert_error(http.post(COMPLETIONS, json=big), 413, code="request_too_large")

    def chunked():  # no Content-Length: the cap applies while reading
        yield b'{"prompt": "'
        for _ in range(MAX_BODY // 1024 + 1):
            yield b"x" * 1024
        yield b'"}'

    assert_error(http.post(COMPLETIONS, content=chunked(), headers={"Content-Type": "application/json"}), 413)
    assert_still_serving(http)


def test_duplicate_request_id_is_400(http, server):
    body = {"prompt_token_ids": [5], "request_id": "dup", "sampling_params": {"max_tokens": 2}}
    assert http.post("/pause", params={"mode": "keep"}, headers=control()).status_code == 200
    with ThreadPoolExecutor(1) as pool:
        try:
            first = pool.submit(http.post, "/inflight/v1/generate", json=body)
            deadline = time.monotonic() + 30
            while not server.engine.engine.has_unfinished_requests():  # the first one is queued
                assert time.monotonic() < deadline
                time.sleep(0.005)
            assert_error(http.post("/inflight/v1/generate", json=body), 400, "request_id")
        finally:
            assert http.post("/resume", headers=control()).status_code == 200
        assert first.result(timeout=60).json()["request_id"] == "dup"  # the first one is unharmed


def test_wrong_weight_shapes_are_4xx_and_server_keeps_serving(http, model_dir):
    name, tensor = next(iter(load_file(str(model_dir / "model.safetensors")).items()))
    assert http.post("/weight_update/begin", headers=control()).status_code == 200
    bad = encode_tensors([(name, tensor.reshape(-1)[:-1].clone())])
    err = assert_error(http.post("/weight_update/chunk", content=bad, headers=control()), 400,
                       code="weight_update_error")
    assert name in err["message"]
    assert_error(http.post("/weight_update/chunk", content=b"\x00" * 64, headers=control()), 400,
                 code="invalid_weights")
    assert_error(
        http.post("/weight_update/chunk", content=b"", headers=control()), 400, code="invalid_weights"
    )
    # a complete update with the right shapes puts the engine back in service
    good = encode_tensors(load_file(str(model_dir / "model.safetensors")).items())
    assert http.post("/weight_update/chunk", content=good, headers=control()).status_code == 200
    assert http.post("/weight_update/finish", headers=control()).json()["success"] is True
    assert_still_serving(http)


@pytest.mark.parametrize("method,route", [
    ("POST", "/pause"), ("POST", "/resume"), ("POST", "/sleep"), ("POST", "/wake_up"),
    ("POST", "/reset_prefix_cache"), ("POST", "/weight_update/begin"), ("POST", "/weight_update/chunk"),
    ("POST", "/weight_update/finish"),
])
def test_control_routes_require_the_token(server, method, route):
    with httpx.Client(base_url=server.url, timeout=30) as c:
        assert_error(c.request(method, route), 401, code="missing_control_token")
        assert_error(c.request(method, route, headers=control("wrong")), 403, code="invalid_control_token")
        assert_error(c.request(method, route, headers={"Authorization": f"Bearer {API_KEY}"}), 403)
        assert c.get("/health").json()["paused"] is False  # nothing happened


def test_openai_routes_require_the_api_key(server):
    with pytest.raises(openai.AuthenticationError):
        OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0).models.list()
    with httpx.Client(base_url=server.url, timeout=30) as c:
        assert_error(c.post(COMPLETIONS, json={"prompt": "x"}), 401, code="missing_api_key")
        assert c.get("/health").status_code == 200 and c.get("/metrics").status_code == 200
    ok = OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)
    assert [m.id for m in ok.models.list()] == ["tiny"]


def test_openai_client_sees_typed_errors(server):
    client = OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)
    with pytest.raises(openai.NotFoundError) as not_found:
        client.completions.create(model="gpt-17", prompt="x")
    assert not_found.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], top_p=0)
    assert bad.value.param == "top_p"


def test_a_bug_is_a_500_with_an_error_body_and_the_server_keeps_serving(server, http):
    with httpx.Client(base_url=server.url, timeout=30, headers={"Authorization": f"Bearer {API_KEY}"}) as c:
        error = assert_error(c.post(COMPLETIONS, json={"prompt": "boom!"}), 500)
    assert error["type"] == "server_error" and "tokenizer exploded" in error["message"]
    assert_still_serving(http)


def test_unknown_route_and_method_are_openai_errors(http):
    assert_error(http.get("/v1/nope"), 404)
    assert_error(http.get(COMPLETIONS), 405)
    assert_error(http.post("/pause", params={"mode": "sideways"}, headers=control()), 400, "mode")
    assert_error(http.post("/wake_up", params={"tags": "gpu"}, headers=control()), 400)
    assert_error(
        http.post("/weight_update/finish", params={"version": "x"}, headers=control()), 400, "version"
    )
    assert_still_serving(http)


@pytest.mark.parametrize("route", [COMPLETIONS, CHAT])
@pytest.mark.parametrize("stream", [False, True])
def test_a_temperature_too_small_to_divide_by_answers_greedy_tokens(http, route, stream):
    """Issue 18 finding 5: temperature 1e-300 gave 400 'Out of range float values' (NaN logprobs);
    streaming wrote NaN into its JSON. It samples greedily now, finite logprobs included."""
    body = {"max_tokens": 4, "logprobs": 2 if route == COMPLETIONS else True, "stream": stream, "seed": 3}
    body |= (
        {"prompt": [5, 6, 7]} if route == COMPLETIONS else {"messages": [{"role": "user", "content": "hi"}]}
    )
    tiny = http.post(route, json={**body, "temperature": 1e-300})
    greedy = http.post(route, json={**body, "temperature": 0})
    assert tiny.status_code == greedy.status_code == 200, tiny.text
    assert "NaN" not in tiny.text and "Infinity" not in tiny.text
    if not stream:  # the same tokens; logprobs within float noise (the second may hit the prefix cache)
        got, want = (r.json()["choices"][0] for r in (tiny, greedy))
        assert got.get("text", got.get("message")) == want.get("text", want.get("message"))
        flat = lambda lp: (  # noqa: E731
            lp["token_logprobs"] if "token_logprobs" in lp else [t["logprob"] for t in lp["content"]]
        )
        assert flat(got["logprobs"]) == pytest.approx(flat(want["logprobs"]), abs=1e-4)


def test_slow_tokenization_does_not_stop_the_server(http):
    """Issue 18 finding 8: tokenization ran on the event loop (a 15 MB prompt froze /health for
    32.6 s). Now it runs in a thread: /health answers while a prompt takes seconds to tokenize."""
    with ThreadPoolExecutor(1) as pool:
        slow = pool.submit(
            http.post, COMPLETIONS, json={"prompt": "slow!", "max_tokens": 2, "temperature": 0}
        )
        time.sleep(0.3)  # the request is in its tokenizer now
        started = time.perf_counter()
        assert http.get("/health").status_code == 200
        waited = time.perf_counter() - started
        assert not slow.done()  # still tokenizing: /health did not wait for it
        assert slow.result().status_code == 200
    assert waited < SLOW_TOKENIZE_S / 2
