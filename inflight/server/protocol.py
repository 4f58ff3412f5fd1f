"""Request bodies of the OpenAI-compatible routes and of `/inflight/v1/generate` (pydantic models).

The OpenAI bodies keep the fields nobody declared (`extra="allow"`) so that `unsupported.check_fields`
can refuse them by name: what the engine does not implement is a 400, never ignored. Extensions in
the body (the `openai` package sends them with `extra_body=`): `top_k`, `ignore_eos`,
`stop_token_ids`, `include_stop_str_in_output`, `cache_salt`, `skip_special_tokens`,
`return_tokens_as_token_ids` (logprob entries name tokens as `token_id:<id>`, as vLLM does), and
`return_token_ids`, which adds `token_ids` and `token_weight_versions` to every choice and
`prompt_token_ids` where vLLM puts them (`choices.py`), and `prompt_logprobs` (vLLM's: the prompt's
scores, k alternatives each). Chat also takes `add_generation_prompt`,
`continue_final_message`, `add_special_tokens`, `chat_template` and `chat_template_kwargs`.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, create_model

from inflight.engine.request import SamplingParams


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")  # e.g. vLLM's continuous_usage_stats: not implemented

    include_usage: bool = False


class OpenAIRequestBase(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # extensions
    top_k: int | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    cache_salt: str | None = None
    skip_special_tokens: bool = True
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool = False
    prompt_logprobs: int | None = None


class CompletionRequest(OpenAIRequestBase):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None


class ChatCompletionRequest(OpenAIRequestBase):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None  # kept as sent: the template renders them key by key
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    # extensions
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class FunctionDefinition(BaseModel):
    """What a tool must look like (validated; the template gets the tool exactly as sent)."""

    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(BaseModel):
    type: Literal["function"]
    function: FunctionDefinition


def _sampling_params_model() -> type[BaseModel]:
    """`SamplingParams` as a pydantic model with the same fields, types and defaults, so that every
    field the engine gains travels on the token route (RemoteClient sends `dataclasses.asdict`)."""
    hints = typing.get_type_hints(SamplingParams)
    fields: dict[str, Any] = {}
    for f in dataclasses.fields(SamplingParams):
        default = (
            f.default if f.default is not dataclasses.MISSING else Field(default_factory=f.default_factory)
        )
        fields[f.name] = (hints[f.name], default)
    return create_model(
        "GenerateSamplingParams",
        __config__=ConfigDict(extra="forbid"),
        __doc__="`SamplingParams` as JSON (unknown fields are an error here: this API is ours).",
        **fields,
    )


GenerateSamplingParams = _sampling_params_model()


class GenerateRequest(BaseModel):
    """Body of `/inflight/v1/generate`: token ids in, token ids + logprobs + weight versions out."""

    model_config = ConfigDict(extra="forbid")

    prompt_token_ids: list[int]
    sampling_params: GenerateSamplingParams = Field(default_factory=GenerateSamplingParams)
    request_id: str | None = None
    cache_salt: str | None = None
    model: str | None = None
    multimodal: dict[str, Any] | None = None
    """The prompt's images for a vision-language model, whose placeholders the prompt holds
    (`inflight.client.wire.encode_images`: the processor's pixel_values and image_grid_thw)."""


PauseMode = Literal["abort", "keep", "wait"]
