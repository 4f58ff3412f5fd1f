"""`max_tokens` against the context, as vLLM 0.32 answers it (read off a vLLM 0.32 server: the shim
serves vLLM's own OpenAI routes; tests/backends/vllm/test_vllm_openai_limits.py holds the two servers
to each other): a budget larger than the whole context is a 400 naming the field and the limit; one
that overruns the context only with the prompt is served up to the end of the context (`length`)."""

from __future__ import annotations

import openai
import pytest

from inflight.engine import EngineConfig
from inflight.server.launch import serve_model

CONTEXT = 64
PROMPT = list(range(5, 25))  # 20 tokens


def vllm_message(param: str, value: int) -> str:
    """vLLM 0.32's message (renderers/params.py, TokenizeParams)."""
    return (
        f"{param}={value} cannot be greater than max_model_len={CONTEXT}. Please request fewer output "
        f"tokens. (parameter={param}, value={value})"
    )


@pytest.fixture(scope="module")
def short(model_dir):
    """The tiny model served with a 64-token context."""
    srv = serve_model(EngineConfig(model=str(model_dir), block_size=4, max_model_len=CONTEXT), "tiny")
    yield openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=60)
    srv.stop()


def _refused(call) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as err:
        call()
    return err.value


def test_a_budget_over_the_context_is_a_400_in_vllm_s_words(short):
    messages = [{"role": "user", "content": "hello"}]
    cases = {
        "max_tokens": lambda: short.completions.create(model="tiny", prompt=PROMPT, max_tokens=CONTEXT + 1),
        "max_completion_tokens": lambda: short.chat.completions.create(
            model="tiny", messages=messages, max_completion_tokens=200
        ),
        "max_output_tokens": lambda: short.responses.create(
            model="tiny", input="hello", max_output_tokens=65
        ),
    }
    values = {"max_tokens": CONTEXT + 1, "max_completion_tokens": 200, "max_output_tokens": 65}
    for param, call in cases.items():
        err = _refused(call)
        assert err.body["message"] == vllm_message(param, values[param]) and err.body["param"] == param
    err = _refused(
        lambda: short.chat.completions.create(model="tiny", messages=messages, max_tokens=CONTEXT + 1)
    )
    assert err.body["message"] == vllm_message("max_tokens", CONTEXT + 1)


def test_a_budget_within_the_context_is_served_to_its_end(short):
    """vLLM clamps max_tokens to what the context leaves after the prompt (no error), and a chat
    without max_tokens runs to the end of the context."""
    whole = short.completions.create(model="tiny", prompt=PROMPT, max_tokens=CONTEXT, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert whole.choices[0].finish_reason == "length"
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (20, CONTEXT - 20)
    chat = short.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert chat.choices[0].finish_reason == "length"
    assert chat.usage.prompt_tokens + chat.usage.completion_tokens == CONTEXT
