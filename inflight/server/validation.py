"""The one validation pass of an OpenAI request, after pydantic has checked the body's types.

In one place and order: the model name (404), `n`, the fields the engine lacks (`unsupported.py`),
stop strings, `best_of`, tools, the logprobs ranges, `max_tokens` against the context (vLLM's
rule: larger than the whole context is a 400) and `echo`/`prompt_logprobs` (vLLM's rules:
echo with `logprobs=k` scores the prompt with k alternatives unless `prompt_logprobs` says otherwise;
`max_tokens=0` only with echo, which then answers the prompt alone; no `prompt_logprobs` in a stream),
each a 400 naming the field. The sampling
values (temperature, top_p, top_k, max_tokens, stop_token_ids, ...) are checked once, by the engine
as it admits the requests (`LLMEngine.check_request`), whose message names the field; every engine
request of a call is admitted before anything is awaited, so such an error is still a 400 before any
response byte (`generation.py`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from inflight.engine.request import SamplingParams
from inflight.server.errors import APIError
from inflight.server.protocol import ChatCompletionRequest, CompletionRequest, OpenAIRequestBase
from inflight.server.tools import parses_tool_calls
from inflight.server.unsupported import check_fields

MAX_N = 128
MAX_LOGPROBS = 20


@dataclass(frozen=True)
class Checked:
    """A request that passed: what each of its engine requests (one per prompt and choice) asks for."""

    req: OpenAIRequestBase
    max_tokens: int | None  # None: up to the end of the context
    top_logprobs: int | None  # None: no logprobs (the engine computes none); k: k alternatives per token
    stops: list[str]
    parse_tool_calls: bool = False
    prompt_logprobs: int | None = None  # the engine's: None, or score the prompt with k alternatives
    echo: bool = False  # completions: the prompt comes first in each choice
    # echo with max_tokens=0: the prompt alone (one token generated and dropped, as vLLM)
    echo_only: bool = False

    def params(self, prompt_len: int, max_model_len: int, choice: int) -> SamplingParams:
        """The engine parameters of choice `choice` of a prompt of `prompt_len` tokens."""
        req = self.req
        if self.echo_only:
            max_tokens = 1
        elif self.max_tokens is None:
            max_tokens = max(1, max_model_len - prompt_len)
        else:
            max_tokens = self.max_tokens
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=0 if req.top_k in (None, -1) else req.top_k,
            seed=req.seed + choice if req.seed is not None else None,  # n choices must differ
            logprobs=self.top_logprobs is not None,
            top_logprobs=self.top_logprobs or 0,
            stop_token_ids=list(req.stop_token_ids or []),
            ignore_eos=req.ignore_eos,
            prompt_logprobs=self.prompt_logprobs,
        )


def check_model(model: str | None, served_model_name: str | None) -> None:
    """A request naming another model is a 404 (no name: the served one; `served_model_name` None:
    any name is taken)."""
    if model is not None and served_model_name is not None and model != served_model_name:
        raise APIError(404, f"the model `{model}` does not exist; this server serves `{served_model_name}`",
                       param="model", code="model_not_found")


def check_chat_template(template: str | None, trusted: bool) -> None:
    """A request's own `chat_template` is code: refused unless the server trusts request templates."""
    if template is not None and not trusted:
        raise APIError(400, "this server does not run chat templates sent with a request (a template is "
                       "code); start it with --trust-request-chat-template to allow them",
                       param="chat_template", code="unsupported_parameter")


def invalid_unicode(value: Any, path: str = "") -> str | None:
    """The dotted path of the first string in `value` (nested dicts and lists) that is not valid
    Unicode (a lone UTF-16 surrogate such as "\\ud800", which JSON can carry and no tokenizer
    can take), or None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path or "(body)"
        return None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        if (found := invalid_unicode(item, f"{path}.{key}" if path else str(key))) is not None:
            return found
    return None


def _check_common(
    req: OpenAIRequestBase, served_model_name: str | None, implemented: frozenset[str]
) -> list[str]:
    """The checks both routes share; returns the stop strings."""
    if (where := invalid_unicode(req.model_dump(exclude_none=True))) is not None:
        raise APIError(400, f"{where} is not valid Unicode (it holds a lone UTF-16 surrogate such as "
                       "\\ud800); send UTF-8 text", param=where.split(".")[0], code="invalid_value")
    check_model(req.model, served_model_name)
    if not 1 <= req.n <= MAX_N:
        raise APIError(400, f"n={req.n} must be between 1 and {MAX_N}", param="n", code="invalid_value")
    check_fields(req, implemented)
    _check_range("prompt_logprobs", req.prompt_logprobs)
    if req.stream and req.prompt_logprobs is not None:
        raise APIError(
            400,
            "prompt_logprobs are not available when stream=true (as vLLM); send stream=false, "
            "or echo=true with logprobs on /v1/completions",
            param="prompt_logprobs",
            code="invalid_value",
        )
    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if any(s == "" for s in stops):
        raise APIError(400, "stop strings must not be empty", param="stop", code="invalid_value")
    return stops


def _check_range(param: str, value: int | None) -> None:
    if value is not None and not 0 <= value <= MAX_LOGPROBS:
        raise APIError(400, f"{param}={value} must be between 0 and {MAX_LOGPROBS}", param=param,
                       code="invalid_value")


def check_max_tokens(value: int | None, param: str, max_model_len: int) -> None:
    """vLLM 0.32's rule and message: an output budget larger than the whole context is a 400; one that
    only overruns it with the prompt is served up to the end of the context (finish `length`)."""
    if value is not None and value > max_model_len:
        raise APIError(400, f"{param}={value} cannot be greater than max_model_len={max_model_len}. Please "
                       f"request fewer output tokens. (parameter={param}, value={value})", param=param,
                       code="invalid_value")


def check_completion(req: CompletionRequest, served_model_name: str | None, max_model_len: int) -> Checked:
    """Validate a `/v1/completions` body; raises APIError naming the first bad field."""
    stops = _check_common(req, served_model_name, frozenset({"echo"}))
    check_max_tokens(req.max_tokens, "max_tokens", max_model_len)
    if req.best_of is not None and req.best_of != req.n:
        raise APIError(400, "best_of is not supported by this server (leave it unset or equal to n)",
                       param="best_of", code="unsupported_parameter")
    _check_range("logprobs", req.logprobs)
    echo_only = req.echo and req.max_tokens == 0
    if req.max_tokens == 0 and not req.echo:
        raise APIError(400, "max_tokens=0 generates nothing: it is allowed only with echo=true (the prompt "
                       "alone, with its logprobs when asked)", param="max_tokens", code="invalid_value")
    prompt_logprobs = req.prompt_logprobs
    if prompt_logprobs is None and req.echo:
        prompt_logprobs = req.logprobs
    return Checked(req, req.max_tokens, req.logprobs, stops, prompt_logprobs=prompt_logprobs, echo=req.echo,
                   echo_only=echo_only)


def check_chat(req: ChatCompletionRequest, served_model_name: str | None, max_model_len: int) -> Checked:
    """Validate a `/v1/chat/completions` body; raises APIError naming the first bad field."""
    stops = _check_common(req, served_model_name, frozenset())
    parse_calls = parses_tool_calls(req)
    _check_range("top_logprobs", req.top_logprobs)
    if req.top_logprobs and not req.logprobs:
        raise APIError(400, "top_logprobs requires logprobs=true", param="top_logprobs", code="invalid_value")
    newer = req.max_completion_tokens is not None  # it wins over max_tokens, as in vLLM
    max_tokens = req.max_completion_tokens if newer else req.max_tokens
    check_max_tokens(max_tokens, "max_completion_tokens" if newer else "max_tokens", max_model_len)
    return Checked(req, max_tokens, (req.top_logprobs or 0) if req.logprobs else None, stops, parse_calls,
                   prompt_logprobs=req.prompt_logprobs)


__all__ = ["MAX_LOGPROBS", "MAX_N", "Checked", "check_chat", "check_chat_template", "check_completion",
           "check_max_tokens", "check_model", "invalid_unicode"]
