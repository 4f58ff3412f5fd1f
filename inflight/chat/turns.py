"""The tokens a chat template puts between two assistant turns, for token-in/token-out multi-turn.

A multi-turn episode keeps the model's sampled token ids verbatim (never decoded and re-encoded);
what comes between one assistant turn and the next is the template's: the end of the assistant turn
(`<|im_end|>\\n`), the observation messages (a `tool` result, a `user` message), the next generation
prompt (`<|im_start|>assistant\\n`). `between_turns` renders the conversation so far with a marker
as the last assistant turn's content, then the observations, with the generation prompt, and
returns the tokens of what the template wrote after the marker.

Unlike the fixed-base method (SkyRL's: the difference of two renderings of a stand-in conversation)
this needs no prefix property of the whole rendering: a template that renders earlier turns
differently once later turns exist (Qwen3 drops earlier turns' `<think>` and adds an empty one to
the last) still gives exactly the tokens it puts after an assistant turn, in this conversation's
context (its tools, its roles). What is checked, with a `ChatTemplateError` naming the problem:
there is a chat template, and it writes an assistant's content verbatim (exactly once).

The text after the marker is tokenized on its own. Where a template ends its turns with a special
token (`<|im_end|>`, `<|eot_id|>`: every chat model's) that is exactly how the whole conversation
tokenizes; where it ends them with plain text, re-tokenizing the conversation could merge the
model's last characters with the template's first ones into other tokens: token-in/token-out keeps
the ids the model actually sampled and saw, which is the point.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

Message = dict[str, Any]
MARKER = "INFLIGHTxTURNxEND"
"""The stand-in content of the last assistant turn (letters only: no template strips or escapes it)."""
RESERVED_KWARGS = ("messages", "tools", "add_generation_prompt", "tokenize", "chat_template")
"""Arguments of `apply_chat_template` that the rendering sets itself (not extra template arguments)."""


class ChatTemplateError(ValueError):
    """The tokenizer's chat template cannot be used for token-in/token-out multi-turn episodes."""


@dataclass(frozen=True)
class ChatFormat:
    """How chat messages become text: `template` (Jinja) instead of the tokenizer's own (None: the
    tokenizer's), and `kwargs`, extra arguments of every rendering (`{"enable_thinking": False}`)."""

    template: str | None = None
    kwargs: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        taken = sorted(set(self.kwargs) & set(RESERVED_KWARGS))
        if taken:
            raise ChatTemplateError(f"chat template arguments {taken} are set by the rendering itself; "
                                    "drop them from generator.chat_template_kwargs")

    def has_template(self, tokenizer: Any) -> bool:
        """Whether messages can be rendered for `tokenizer` (a template here or the tokenizer's own)."""
        return self.template is not None or getattr(tokenizer, "chat_template", None) is not None


PLAIN = ChatFormat()
"""The tokenizer's own template, no extra arguments."""


def render(tokenizer: Any, messages: Sequence[Message], tools: Sequence[dict] | None = None,
           add_generation_prompt: bool = False, fmt: ChatFormat = PLAIN) -> str:
    """The chat template's text of `messages` (with `tools` when given), in the format `fmt`."""
    if not fmt.has_template(tokenizer):
        raise ChatTemplateError("chat-message observations and tools need a tokenizer with a chat template; "
                                f"{type(tokenizer).__name__} has none (return text observations instead)")
    kwargs = {"tools": list(tools)} if tools else {}
    if fmt.template is not None:
        kwargs["chat_template"] = fmt.template
    return tokenizer.apply_chat_template(list(messages), tokenize=False,
                                         add_generation_prompt=add_generation_prompt, **kwargs, **fmt.kwargs)


def encode(tokenizer: Any, text: str) -> list[int]:
    """Token ids of text, none added (a rendered template's special tokens are in its text). A
    fast tokenizer's backend encodes directly where transformers' encoding is its own: the same ids
    without transformers' per-call BatchEncoding (in a fully-async run this encoding competes with
    the train step for the GIL)."""
    backend = backend_for(tokenizer, ENCODING)
    if backend is not None:
        return backend.encode(text, add_special_tokens=False).ids
    return [int(t) for t in tokenizer(text, add_special_tokens=False)["input_ids"]]


ENCODING = ("__call__", "_encode_plus")  # what `tokenizer(text)` runs through
DECODING = ("decode", "_decode")


def backend_for(tokenizer: Any, methods: tuple[str, ...]) -> Any:
    """The `tokenizers` backend of `tokenizer` when its `methods` are transformers' own over that
    backend (then the backend gives the same ids or text; a class that overrides one, such as
    CodeLlama's `_encode_plus`, is not bypassed), else None."""
    return tokenizer.backend_tokenizer if _plain_methods(type(tokenizer), methods) else None


@functools.cache
def _plain_methods(cls: type, methods: tuple[str, ...]) -> bool:
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    return issubclass(cls, TokenizersBackend) and all(
        getattr(cls, m) is getattr(TokenizersBackend, m) for m in methods
    )


def between_turns(tokenizer: Any, history: Sequence[Message], observations: Sequence[Message],
                  tools: Sequence[dict] | None = None, fmt: ChatFormat = PLAIN) -> list[int]:
    """Token ids the template writes after the content of an assistant turn that follows `history`:
    the end of that turn, `observations`, and the next assistant generation prompt."""
    return encode(tokenizer, text_between_turns(tokenizer, history, observations, tools, fmt))


def text_between_turns(tokenizer: Any, history: Sequence[Message], observations: Sequence[Message],
                       tools: Sequence[dict] | None = None, fmt: ChatFormat = PLAIN) -> str:
    """The text of `between_turns` (a vision-language model's processor expands its image
    placeholders as it tokenizes it)."""
    messages = [*history, {"role": "assistant", "content": MARKER}, *observations]
    text = render(tokenizer, messages, tools, add_generation_prompt=True, fmt=fmt)
    if text.count(MARKER) != 1:
        raise ChatTemplateError(
            "the chat template does not write an assistant turn's content verbatim (found it "
            f"{text.count(MARKER)} times), so the tokens between turns cannot be told apart from the "
            "model's; token-in/token-out multi-turn needs a template that does")
    return text[text.index(MARKER) + len(MARKER):]


def as_messages(observation: Message | Sequence[Message]) -> list[Message]:
    """An observation given as one message or a list of them, checked to be chat messages."""
    messages = [observation] if isinstance(observation, dict) else list(observation)
    for m in messages:
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and "content" in m):
            raise TypeError(f"an observation message must be a dict with 'role' and 'content', got {m!r}")
    return messages
