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

Images (a vision-language model's task, `task.vision`): an opening whose messages hold image parts is
encoded through the model's processor (placeholders expanded, `dataset.image_prompt`), and so are
observation messages holding images (SkyRL's environments may return them: chat messages with image
parts), whose images follow the earlier ones; `images` is every image of the episode so far, in the
order of their placeholders (what each turn's request and the trainer's forward take). Image
observations need chat messages (`conversation=True`): appended to the response they have no
placeholder.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from inflight.chat.images import count_images
from inflight.chat.turns import as_messages, between_turns, text_between_turns
from inflight.chat.vision import ImagePrompt
from inflight.engine.multimodal import MultimodalInput
from inflight.tasks.base import Task
from inflight.tasks.dataset import image_prompt


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
        self.images: MultimodalInput | None = None
        """Every image of the episode so far (the opening's, then the observations'), or None."""
        if count_images(self.messages):
            if self.tools:
                raise ValueError("an opening with images and an environment with tools: the tools' chat "
                                 "rendering takes text prompts only")
            prompt = image_prompt(task, self.messages)
            self.prompt_ids = prompt.token_ids
            self._add_images(prompt)
        elif self.tools:  # the template lists the tools (a system turn, for Qwen's)
            self.prompt_ids = task.encode_chat(self.messages, self.tools)
        else:
            self.prompt_ids = task.encode_prompt(opening)

    def _add_images(self, prompt: ImagePrompt) -> None:
        new = MultimodalInput(prompt.pixel_values, prompt.image_grid_thw)
        old = self.images
        self.images = (
            new
            if old is None
            else MultimodalInput(
                torch.cat((old.pixel_values, new.pixel_values)),
                torch.cat((old.image_grid_thw, new.image_grid_thw)),
            )
        )

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
        if count_images(messages):
            ids = self._image_observation(history, messages)
        else:
            ids = between_turns(self.task.tokenizer, history, messages, self.tools, self.task.chat_format)
        eos = self.task.tokenizer.eos_token_id
        if ids and ((ids[0] == last_token and ids[0] in stop_ids) or (drop_eos and ids[0] == eos)):
            ids = ids[1:]
        return ids


    def _image_observation(self, history: list[dict[str, Any]], messages: list[dict[str, Any]]) -> list[int]:
        """The tokens between turns with the observation's image placeholders expanded by the model's
        processor; its images are added to `images`."""
        vision = getattr(self.task, "vision", None)
        if vision is None:
            raise ValueError(
                f"the observation holds {count_images(messages)} image(s), but the task has no image "
                "processor (a text-only model): return text observations, or train a "
                "vision-language model"
            )
        split = vision.split(messages, param="observation")
        text = text_between_turns(
            self.task.tokenizer, history, split.messages, self.tools, self.task.chat_format
        )
        prompt = vision.expand(text, split.images)
        self._add_images(prompt)
        return prompt.token_ids


def _content(message: dict[str, Any]) -> str:
    content = message["content"]
    if not isinstance(content, str):
        raise TypeError(
            f"an observation appended to the response (generator.use_conversation_multi_turn=false) "
            f"needs text content, got {type(content).__name__} (images need chat messages: "
            "generator.use_conversation_multi_turn=true)"
        )
    return content
