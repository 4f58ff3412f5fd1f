"""`Task.encode` gives transformers' ids (memoised, from the fast tokenizer's backend),
`Task.decode` transformers' text (from the backend where that is the same), and `in_thread` reuses
its daemon threads while a hung call still holds only its own."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from inflight.chat.turns import DECODING, ENCODING, backend_for
from inflight.tasks import AdditionTask
from inflight.tasks.base import in_thread
from inflight.testing import make_tokenizer

TEXTS = {  # the character tokenizer knows only its task's characters
    "chars": ["12+34=", "", "7+0=", "12+34="],
    "trained": [
        "12+34=",
        "",
        "  spaced  out ",
        "héllo wörld ✓",
        "<|im_start|>user\nhi<|im_end|>",
        "a\n\nb\t c",
        "12+34=",
    ],
}


@pytest.mark.parametrize("tokenizer", ["chars", "trained"])
def test_encode_equals_the_tokenizers_own_ids(tokenizer):
    task = AdditionTask() if tokenizer == "chars" else AdditionTask(make_tokenizer())
    for text in TEXTS[tokenizer]:
        expected = list(task.tokenizer(text, add_special_tokens=False)["input_ids"])
        first, again = task.encode(text), task.encode(text)
        assert first == again == expected, text
        first.append(-1)  # a caller's list is its own: the memo is not changed through it
        assert task.encode(text) == expected


def test_a_tokenizer_that_overrides_its_encoding_is_not_bypassed():
    """A class overriding `_encode_plus` (as CodeLlama's does) gives its own ids, not the backend's."""
    tokenizer = make_tokenizer()

    class Marking(type(tokenizer)):
        def _encode_plus(self, *args, **kwargs):
            encoded = super()._encode_plus(*args, **kwargs)
            encoded["input_ids"] = [7, *encoded["input_ids"]]
            return encoded

    tokenizer.__class__ = Marking
    task = AdditionTask(tokenizer)
    assert backend_for(tokenizer, ENCODING) is None and backend_for(tokenizer, DECODING) is not None
    for text in TEXTS["trained"]:
        assert task.encode(text) == list(tokenizer(text, add_special_tokens=False)["input_ids"])
        assert task.encode(text)[0] == 7


@pytest.mark.parametrize("tokenizer", ["chars", "trained", "trained_cleanup"])
def test_decode_equals_the_tokenizers_own_text(tokenizer):
    task = AdditionTask() if tokenizer == "chars" else AdditionTask(make_tokenizer())
    if tokenizer == "trained_cleanup":  # transformers' own path then (it may change spaces)
        task.tokenizer.clean_up_tokenization_spaces = True
    fast = (
        backend_for(task.tokenizer, DECODING) is not None and not task.tokenizer.clean_up_tokenization_spaces
    )
    assert fast == (tokenizer != "trained_cleanup")
    special = task.tokenizer.all_special_ids
    for text in TEXTS[tokenizer.removesuffix("_cleanup")]:
        ids = task.encode(text)
        for sequence in (ids, [*special, *ids, *special], ids[1:]):  # special tokens are skipped
            assert task.decode(sequence) == task.tokenizer.decode(sequence, skip_special_tokens=True), text


def test_in_thread_reuses_threads_and_a_hung_call_blocks_no_other():
    release = threading.Event()

    async def scenario() -> tuple[list[threading.Thread], float]:
        hung = in_thread(release.wait, 30)  # holds its thread until released
        started = time.perf_counter()
        threads = [await in_thread(threading.current_thread) for _ in range(50)]
        took = time.perf_counter() - started
        release.set()
        assert await hung is True
        return threads, took

    before = {t for t in threading.enumerate() if t.name == "inflight-env-call"}  # idle ones of earlier tests
    threads, took = asyncio.run(scenario())
    assert took < 10  # the hung call held back none of the 50
    assert {t.name for t in threads} == {"inflight-env-call"} and all(t.daemon for t in threads)
    assert len(set(threads) - before) <= 2  # 50 calls one after another reuse threads: not 50 new ones
