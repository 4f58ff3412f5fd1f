"""Request bodies of the OpenAI-compatible routes and of `/inflight/v1/generate` (pydantic models).

The OpenAI bodies ignore unknown fields (as OpenAI-compatible servers do) and take a few extensions
in the body (the `openai` package sends them with `extra_body=`): `top_k`, `ignore_eos`,
`stop_token_ids`, `cache_salt`, `skip_special_tokens`, and `return_token_ids`, which adds
`token_ids` and `token_weight_versions` to every choice (and `prompt_token_ids` to the response).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class StreamOptions(BaseModel):
    include_usage: bool = False


class OpenAIRequestBase(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="ignore")

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
    cache_salt: str | None = None
    skip_special_tokens: bool = True
    return_token_ids: bool = False


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
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None
    # extensions
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


class GenerateSamplingParams(BaseModel):
    """`SamplingParams` as JSON (unknown fields are an error here: this API is ours)."""

    model_config = ConfigDict(extra="forbid")

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    logprobs: bool = True
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False


class GenerateRequest(BaseModel):
    """Body of `/inflight/v1/generate`: token ids in, token ids + logprobs + weight versions out."""

    model_config = ConfigDict(extra="forbid")

    prompt_token_ids: list[int]
    sampling_params: GenerateSamplingParams = Field(default_factory=GenerateSamplingParams)
    request_id: str | None = None
    cache_salt: str | None = None
    model: str | None = None


PauseMode = Literal["abort", "keep", "wait"]
