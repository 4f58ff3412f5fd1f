"""A token's own bytes (the chat logprobs' `bytes`): joined over a text's tokens they are its UTF-8.

Decoding one token alone turns a token that holds part of a UTF-8 character into U+FFFD, whose bytes
are not the token's. The token's bytes come from the tokenizer's own mapping instead:
- byte-level BPE (GPT-2, Qwen, Llama 3: a `ByteLevel` decoder): each character of the token's string
  stands for one byte (transformers' `bytes_to_unicode` table, inverted);
- byte fallback (SentencePiece models such as Llama 2, Mistral): a token `<0xNN>` is the byte NN,
  other tokens their text with the metaspace `▁` as a space;
- any other tokenizer, and added tokens (special tokens, `<tool_call>`): the UTF-8 of the token's
  decoded text, exact for tokens that hold whole characters.
"""

from __future__ import annotations

import json
import re
from functools import lru_cache
from typing import Any

METASPACE = "\u2581"
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@lru_cache(maxsize=1)
def _byte_of_char() -> dict[str, int]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {char: byte for byte, char in bytes_to_unicode().items()}


def _decoder_types(tokenizer: Any) -> set[str]:
    """The `type`s of the fast tokenizer's decoder (and of the decoders in a Sequence); empty for a
    tokenizer without a `tokenizers` backend."""
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    if decoder is None:
        return set()
    try:
        decoder = json.loads(decoder.__getstate__())  # the decoder alone, as JSON
    except (ValueError, TypeError, AttributeError):
        return set()
    found, todo = set(), [decoder]
    while todo:
        node = todo.pop()
        found.add(node.get("type"))
        todo.extend(node.get("decoders") or [])
    return found


class TokenBytes:
    """`token_bytes(token_id) -> list[int]`: the token's own bytes, cached per id."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        types = _decoder_types(tokenizer)
        self.byte_level = "ByteLevel" in types
        self.byte_fallback = "ByteFallback" in types
        self.added = set(getattr(tokenizer, "added_tokens_decoder", {}) or {})
        self._cache: dict[int, list[int]] = {}

    def __call__(self, token_id: int) -> list[int]:
        found = self._cache.get(token_id)
        if found is None:
            found = self._cache[token_id] = list(self._bytes(token_id))
        return found

    def _bytes(self, token_id: int) -> bytes:
        if token_id not in self.added and (self.byte_level or self.byte_fallback):
            piece = self.tokenizer.convert_ids_to_tokens(token_id)
            if isinstance(piece, str):
                if self.byte_level:
                    table = _byte_of_char()
                    if all(c in table for c in piece):
                        return bytes(table[c] for c in piece)
                elif m := _BYTE_TOKEN.fullmatch(piece):
                    return bytes([int(m.group(1), 16)])
                else:
                    return piece.replace(METASPACE, " ").encode()
        return self.tokenizer.decode([token_id], skip_special_tokens=False).encode()


__all__ = ["TokenBytes"]
