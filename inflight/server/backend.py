"""What the OpenAI routes generate with, and what one API request runs on.

`Backend`: the two calls the routes make, `generate` (the final output) and `generate_stream` (a
snapshot after each step, the last one finished). An `AsyncEngine` is one, and so is every
`InferenceClient` (in process, engine processes, Ray actors, HTTP servers; a client that cannot
stream gives the final output as its only snapshot).

`CallScope`: one API request's backend, how its prompts become token ids, and what happens when its
engine calls are done. The plain server's scope is the engine, the chat template and nothing; the
trainer's agent endpoint (`inflight.agents`) gives each session's requests a scope that records
every call and continues a conversation from the tokens the model sampled.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any, Protocol, runtime_checkable

from inflight.chat.vision import Vision
from inflight.engine.request import RequestOutput, SamplingParams
from inflight.server.chat_prompt import chat_prompt
from inflight.server.protocol import ChatCompletionRequest


@runtime_checkable
class Backend(Protocol):
    """Generation as the routes call it (an AsyncEngine, an InferenceClient)."""

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams | None = None, *,
                       request_id: str | None = None, cache_salt: str | None = None) -> RequestOutput:
        """The request's final output (across any pause and weight update)."""
        ...

    def generate_stream(self, prompt_token_ids: list[int], params: SamplingParams | None = None, *,
                        request_id: str | None = None, cache_salt: str | None = None
                        ) -> AsyncIterator[RequestOutput]:
        """Snapshots of the request, the last one finished."""
        ...


class CallScope:
    """What one API request runs on (the plain server's: `backend`, the chat template, no record;
    `vision`: the model's processor and image limits, None for a text-only model).

    `chat_prompt` and `text_prompt` run in a worker thread (templating and tokenizing never run on
    the event loop); `finished` is called on the loop once every engine call of the request has
    finished and its last delta was handed out (not when the request failed or its client left)."""

    def __init__(self, backend: Backend, vision: Vision | None = None) -> None:
        self.backend = backend
        self.vision = vision

    def chat_prompt(self, tokenizer: Any, req: ChatCompletionRequest) -> list[int]:
        """The prompt token ids of a chat request (`/v1/chat/completions`, `/v1/responses`); with
        images, a `chat_prompt.ImageIds` carrying them."""
        return chat_prompt(tokenizer, req, self.vision)

    def text_prompt(self, tokenizer: Any, text: str) -> list[int]:
        """The prompt token ids of a text prompt (`/v1/completions`)."""
        return list(tokenizer(text)["input_ids"])

    def finished(self, calls: Sequence[Any]) -> None:
        """Every engine call of the request is done (`generation.EngineCall`s: their trackers hold what
        the client got)."""


__all__ = ["Backend", "CallScope"]
