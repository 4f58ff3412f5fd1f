"""Request fields this server does not implement: a 400 naming the field, never silently ignored.

Every field of an OpenAI-compatible body is one of: implemented (declared in `protocol.py`),
harmless metadata (accepted, it changes nothing the model does), or listed here with the value
that means "off" (OpenAI's and vLLM's defaults, so clients that send defaults keep working). A
non-default value of a listed field, or a field nobody declared (a typo, a vLLM extension we lack),
is refused with `param` set to its name, as OpenAI refuses unrecognized arguments.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pydantic import BaseModel

from inflight.server.errors import APIError

METADATA = frozenset({"user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier"})


def _is(*neutral: Any) -> Callable[[Any], bool]:
    return lambda value: value is None or any(value == n for n in neutral)


_OFF = _is()  # only null (or absent) is accepted
_ZERO, _ONE = _is(0), _is(1)

# field -> (accepted when, what to do instead)
REFUSED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "presence_penalty": (_ZERO, "penalties are not implemented by the engine; use 0"),
    "frequency_penalty": (_ZERO, "penalties are not implemented by the engine; use 0"),
    "repetition_penalty": (_ONE, "penalties are not implemented by the engine; use 1"),
    "length_penalty": (_ONE, "beam search is not implemented; use 1"),
    "logit_bias": (_is({}), "logit_bias is not implemented by the engine"),
    "min_p": (_ZERO, "min_p is not implemented by the engine; use top_p or top_k"),
    "min_tokens": (_ZERO, "min_tokens is not implemented by the engine"),
    "use_beam_search": (_is(False), "beam search is not implemented"),
    "allowed_token_ids": (_OFF, "allowed_token_ids is not implemented by the engine"),
    "bad_words": (_is([]), "bad_words is not implemented by the engine"),
    "logits_processors": (_OFF, "custom logits processors are not supported"),
    "truncate_prompt_tokens": (_OFF, "prompts are never truncated; shorten the prompt"),
    "spaces_between_special_tokens": (_is(True), "only the default (true) is implemented"),
    "priority": (_ZERO, "request priorities are not implemented (first come, first served)"),
    "guided_json": (_OFF, "guided (constrained) decoding is not implemented"),
    "guided_regex": (_OFF, "guided (constrained) decoding is not implemented"),
    "guided_choice": (_OFF, "guided (constrained) decoding is not implemented"),
    "guided_grammar": (_OFF, "guided (constrained) decoding is not implemented"),
    "guided_decoding_backend": (_OFF, "guided (constrained) decoding is not implemented"),
    "guided_whitespace_pattern": (_OFF, "guided (constrained) decoding is not implemented"),
    "structural_tag": (_OFF, "guided (constrained) decoding is not implemented"),
    "structured_outputs": (_OFF, "guided (constrained) decoding is not implemented"),
    "response_format": (_is({"type": "text"}), "structured outputs are not implemented; only type 'text'"),
    "kv_transfer_params": (_OFF, "KV transfer is not implemented"),
    "vllm_xargs": (_OFF, "vLLM extension arguments are not supported"),
    "mm_processor_kwargs": (_OFF, "multi-modal inputs are not supported"),
    "prediction": (_OFF, "predicted outputs are not implemented"),
    "audio": (_OFF, "audio output is not supported"),
    "modalities": (_is(["text"]), "only the text modality is supported"),
    "reasoning_effort": (_OFF, "use chat_template_kwargs (e.g. {\"enable_thinking\": false} for Qwen3)"),
    "web_search_options": (_OFF, "web search is not supported"),
    "verbosity": (_OFF, "verbosity is not supported"),
    "functions": (_OFF, "the deprecated `functions` field is not supported; send `tools`"),
    "function_call": (_OFF, "the deprecated `function_call` field is not supported; send `tool_choice`"),
    "parallel_tool_calls": (_is(True), "the model may always make several calls; omit it or use true"),
    "documents": (_OFF, "documents are not supported; put them in the messages"),
    "echo": (_is(False), "echo is implemented on /v1/completions only (vLLM's chat echo of the last message "
                         "is not)"),
    "suffix": (_OFF, "suffix is not supported by this server"),
}


def check_fields(req: BaseModel, implemented: frozenset[str] = frozenset()) -> None:
    """Raise APIError(400) for the first refused or unrecognized field of `req` (declared fields
    and extras alike), naming it in `param`; `implemented`: listed fields this route implements."""
    values = {name: getattr(req, name) for name in type(req).model_fields}
    values.update(req.model_extra or {})
    for name, value in values.items():
        if name in REFUSED and name not in implemented:
            accepted, fix = REFUSED[name]
            if not accepted(value):
                raise APIError(400, f"{name}={value!r} is not supported by this server: {fix}", param=name,
                               code="unsupported_parameter")
    for name in req.model_extra or {}:
        if name not in REFUSED and name not in METADATA:
            raise APIError(400, f"unrecognized request argument supplied: {name}", param=name,
                           code="unknown_parameter")
