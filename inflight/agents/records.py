"""What an agent session records of each model call: the exact tokens, as the engine gave them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ChatTurn:
    """What a chat call's successor must repeat to continue it token for token: the call's messages
    (as the template read them, `canonical`), its tools and template, and the reply the client got."""

    messages: tuple[Any, ...]
    """The request's messages, each as `continuation.canonical` makes it (comparable)."""
    rendered: tuple[dict[str, Any], ...]
    """The same messages as the chat template read them (the history `between_turns` renders)."""
    tools: Any
    template: tuple[str | None, str]
    """(chat template, its extra arguments as sorted JSON): the rendering's identity."""
    reply: Any
    """The assistant message the client got, canonical."""


@dataclass(frozen=True)
class CallRecord:
    """One model call of a session: the prompt token ids as rendered, and the sampled token ids, the
    engine's log-probabilities and weight versions verbatim (up to the stop string that ended the
    reply, when one did), in the order the calls finished."""

    index: int
    prompt_ids: list[int]
    output_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str
    num_cached_tokens: int = 0
    num_recomputed_tokens: int = 0
    chat: ChatTurn | None = None
    text: tuple[str, str] | None = None
    """A text completion's (prompt, reply) as the client sent and got them."""

    @property
    def tokens(self) -> list[int]:
        """The prompt and the sampled ids: what a continuation of this call starts with."""
        return [*self.prompt_ids, *self.output_ids]


__all__ = ["CallRecord", "ChatTurn"]
