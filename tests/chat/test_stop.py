"""Stop strings over token ids: the first stop string to complete ends the response at the token
that completed it; the text drops or keeps it (vLLM's include_stop_str_in_output)."""

from __future__ import annotations

import pytest

from inflight.chat.stop import first_stop, single_token_stops, truncate_at_stop
from inflight.testing.tiny_model import make_tokenizer


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


def ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def test_first_stop_is_the_first_completed():
    assert first_stop("abcd", ["bcd", "ab"]) == (0, "ab")
    assert first_stop("xbcdab", ["bcd", "ab"]) == (1, "bcd")
    assert first_stop("aab", ["ab", "aab"]) == (0, "aab")  # same end: the one that starts first
    assert first_stop("abc", ["zz", ""]) is None


def test_truncate_at_stop_keeps_the_token_that_completed_it(tok):
    text = "the answer is 42. then more words"
    tokens = ids(tok, text)
    decode = lambda t: tok.decode(t, skip_special_tokens=True)  # noqa: E731
    for stop in ("42.", "is 4", " then", "s 42"):
        match = truncate_at_stop(tokens, [stop], decode)
        end = text.index(stop) + len(stop)
        # the shortest prefix of tokens whose text holds the stop string
        want = next(k for k in range(1, len(tokens) + 1) if stop in decode(tokens[:k]))
        assert match.num_tokens == want and decode(tokens[:want]).startswith(text[:end])
        assert match.text == text[: text.index(stop)] and match.stop == stop
        kept = truncate_at_stop(tokens, [stop], decode, include_stop=True)
        assert kept.text == text[:end] and kept.num_tokens == want
    assert truncate_at_stop(tokens, ["nowhere"], decode) is None


def test_single_token_stops(tok):
    raw = lambda t: tok.decode(t, skip_special_tokens=False)  # noqa: E731
    enc = lambda s: ids(tok, s)  # noqa: E731
    the, eos = enc("the"), tok.convert_tokens_to_ids("<|im_end|>")
    assert len(the) == 1 and len(enc("answer")) > 1
    assert single_token_stops(["the", "answer", "<|im_end|>", ""], enc, raw) == [the[0], eos]
