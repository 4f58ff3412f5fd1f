"""A character-level tokenizer for the arithmetic task, as a real `PreTrainedTokenizerFast`.

Fourteen tokens: the ten digits, `+`, `=`, an end-of-sequence token and a padding token. It saves and
loads like any Hugging Face tokenizer (`save_pretrained` / `AutoTokenizer.from_pretrained`) and has a
chat template, so the model directory it goes into works with every tool that expects one.
"""

from __future__ import annotations

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

PAD_TOKEN = "<pad>"
EOS_TOKEN = "<eos>"
CHARS = "0123456789+="
VOCAB: dict[str, int] = {PAD_TOKEN: 0, EOS_TOKEN: 1} | {c: i + 2 for i, c in enumerate(CHARS)}
# The prompt is the conversation's text as is: `12+34=`; an assistant turn ends with EOS.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ message['content'] }}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}"
    "{% endfor %}"
)


def make_char_tokenizer(chars: str = CHARS) -> PreTrainedTokenizerFast:
    """The character tokenizer: one token per character of `chars`, plus `<pad>` (0) and `<eos>` (1)."""
    vocab = {PAD_TOKEN: 0, EOS_TOKEN: 1} | {c: i + 2 for i, c in enumerate(chars)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([PAD_TOKEN, EOS_TOKEN])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN, bos_token=None, unk_token=None
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast
