"""An episode's turns: a model turn after stop strings, and the tokens an observation adds after it.

Two ways to put an observation after the model's turn (SkyRL's `use_conversation_multi_turn`):
- as chat messages (`conversation=True`, default): the tokens the chat template writes after the
  assistant turn (`inflight.chat.turns.between_turns`: the end of the turn, the observation
  messages, the next generation prompt), less the end-of-turn token when the response already ends
  with it (the model sampled it, or it was appended after a stop string); after a stop string with
  nothing appended, without the EOS (SkyRL's tokens: the turn is not closed);
- appended to the assistant's response (`conversation=False`): each observation message's content
  as its own tokens, no template, no generation prompt; the model's EOS before it is dropped, so
  the whole episode is one assistant message.
A text observation (our environments may return one) is its tokens in both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from inflight.chat.turns import as_messages, between_turns
from inflight.tasks.base import Task


@dataclass
class Turn:
    """One model turn after stop strings: what is kept, the text the environment sees (`text`: as
    `include_stop_str_in_output` says; `full_text`: with the stop string), why it ended, and whether
    a stop string ended it."""

    tokens: list[int]
    logprobs: list[float]
    versions: list[int]
    text: str
    finish_reason: str
    full_text: str = ""
    stopped_by_string: bool = False


class Conversation:
    """An episode's chat so far (the context the template renders observation messages in)."""

    def __init__(self, task: Task, opening: str | list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                 conversation: bool = True) -> None:
        self.task, self.tools, self.conversation = task, tools or None, conversation
        self.messages = [{"role": "user", "content": opening}] if isinstance(opening, str) else list(opening)
        if self.tools:  # the template lists the tools (a system turn, for Qwen's)
            self.prompt_ids = task.encode_chat(self.messages, self.tools)
        else:
            self.prompt_ids = task.encode_prompt(opening)

    def observation_ids(self, said: str, observation: Any, last_token: int | None, stop_ids: set[int],
                        drop_eos: bool = False) -> list[int]:
        """The tokens that follow the model's turn (whose text is `said`; the response so far ends
        with `last_token`): see the module docstring. `drop_eos`: the turn ended at a stop string and
        no EOS was appended (the template's EOS is left out too)."""
        history = list(self.messages)
        self.messages.append({"role": "assistant", "content": said})
        if isinstance(observation, str):
            return self.task.encode(observation)
        messages = as_messages(observation)
        self.messages += messages
        if not self.conversation:
            return [t for m in messages for t in self.task.encode(_content(m))]
        ids = between_turns(self.task.tokenizer, history, messages, self.tools, self.task.chat_format)
        eos = self.task.tokenizer.eos_token_id
        if ids and ((ids[0] == last_token and ids[0] in stop_ids) or (drop_eos and ids[0] == eos)):
            ids = ids[1:]
        return ids


def _content(message: dict[str, Any]) -> str:
    content = message["content"]
    if not isinstance(content, str):
        raise TypeError(f"an observation appended to the response (generator.use_conversation_multi_turn=false) "
                        f"needs text content, got {type(content).__name__}")
    return content
