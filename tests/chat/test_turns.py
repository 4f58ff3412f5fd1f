"""The tokens between two assistant turns, from the chat template itself: with a prefix-stable
template they are the difference of two renderings; with one that is not (Qwen3-style: the last
assistant turn is rendered differently) they are still what the template writes after the turn."""

from __future__ import annotations

import pytest

from inflight.chat.turns import ChatTemplateError, between_turns
from inflight.testing.tiny_model import make_tokenizer

HISTORY = [{"role": "user", "content": "hi"}]
OBS = [{"role": "user", "content": "go on"}]
# Qwen3's trick: the final assistant turn gets an empty <think> block, earlier ones do not
LAST_TURN_DIFFERS = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' and loop.last %}<think>\n\n</think>\n\n{% endif %}"
    "{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture()
def tok():
    return make_tokenizer()


def ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def render(tok, messages, gen=False):
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)


def test_prefix_stable_template_gives_the_rendering_difference(tok):
    said = [*HISTORY, {"role": "assistant", "content": "sure"}]
    before = render(tok, HISTORY, gen=True) + "sure"
    after = render(tok, [*said, *OBS], gen=True)
    assert after.startswith(before)
    assert between_turns(tok, said[:-1], OBS) == ids(tok, after[len(before):])
    assert tok.decode(between_turns(tok, HISTORY, OBS)) == ("<|im_end|>\n<|im_start|>user\ngo on<|im_end|>\n"
                                                            "<|im_start|>assistant\n")


def test_template_that_is_not_prefix_stable_still_gives_what_follows_the_turn(tok):
    tok.chat_template = LAST_TURN_DIFFERS
    said = [*HISTORY, {"role": "assistant", "content": "sure"}]
    # the fixed-base difference would be wrong here: the turn renders differently once not last
    assert not render(tok, [*said, *OBS], gen=True).startswith(render(tok, said))
    full = render(tok, [*said, *OBS], gen=True)
    assert between_turns(tok, HISTORY, OBS) == ids(tok, full[full.index("sure") + len("sure"):])


def test_templates_it_cannot_use_are_named(tok):
    tok.chat_template = "{% for m in messages %}{{ m['role'] }}{% endfor %}"  # drops the content
    with pytest.raises(ChatTemplateError, match="content verbatim"):
        between_turns(tok, HISTORY, OBS)
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{{ m['content'] }}{% endfor %}"  # twice
    with pytest.raises(ChatTemplateError, match="found it 2 times"):
        between_turns(tok, HISTORY, OBS)
    tok.chat_template = None
    with pytest.raises(ChatTemplateError, match="needs a tokenizer with a chat template|need a tokenizer"):
        between_turns(tok, HISTORY, OBS)
