"""Incremental detokenization: streamed deltas join to exactly the full decode, even when a
character spans several byte-level tokens; stop strings are found across delta boundaries."""

from __future__ import annotations

from inflight.engine import RequestOutput
from inflight.server.detokenize import ChoiceTracker, IncrementalDetokenizer

TEXT = "the water is 12+34=46 \u2603 h\u00e9llo w\u00f6rld \U0001f600 end"


def snapshot(ids: list[int], n: int, finished: bool) -> RequestOutput:
    return RequestOutput("r", [1, 2], ids[:n], [-0.5] * n, [0] * n, "length" if finished else None)


def test_deltas_join_to_the_full_decode(tokenizer):
    ids = tokenizer(TEXT)["input_ids"]
    assert len(ids) > len(TEXT.split())  # multi-byte characters take several tokens
    for prompt in ([], [5, 6, 7], tokenizer("prefix ")["input_ids"]):
        detok = IncrementalDetokenizer(tokenizer, prompt)
        deltas = [detok.add([t]) for t in ids]
        deltas.append(detok.flush())
        assert "".join(deltas) == tokenizer.decode(ids) == TEXT
        assert not any("\ufffd" in d for d in deltas)  # partial characters are held back, not emitted


def test_flush_emits_an_incomplete_character_as_decode_does(tokenizer):
    ids = tokenizer("ab \u2603")["input_ids"][:-1]  # cut inside the snowman's bytes
    detok = IncrementalDetokenizer(tokenizer, [])
    text = "".join(detok.add([t]) for t in ids) + detok.flush()
    assert text == tokenizer.decode(ids) and text.endswith("\ufffd")


def test_tracker_finds_a_stop_string_split_across_tokens(tokenizer):
    ids = tokenizer(TEXT)["input_ids"]
    tracker = ChoiceTracker(0, tokenizer, [1, 2], stop=["w\u00f6rld"])
    emitted = []
    for n in range(1, len(ids) + 1):
        delta = tracker.update(snapshot(ids, n, n == len(ids)))
        emitted.append(delta.text)
        if delta.finish_reason:
            break
    assert tracker.stopped and tracker.finish_reason == "stop"
    assert "".join(emitted) == TEXT[: TEXT.index("w\u00f6rld")]
    assert len(tracker.output_token_ids) < len(ids)  # it stopped early


def test_tracker_without_stops_streams_everything_with_tokens_and_versions(tokenizer):
    ids = tokenizer(TEXT)["input_ids"]
    tracker = ChoiceTracker(0, tokenizer, [1, 2])
    deltas = [tracker.update(snapshot(ids, n, n == len(ids))) for n in range(2, len(ids) + 1, 2)]
    if len(ids) % 2:
        deltas.append(tracker.update(snapshot(ids, len(ids), True)))
    assert "".join(d.text for d in deltas) == TEXT
    assert [t for d in deltas for t in d.token_ids] == ids
    assert tracker.logprobs == [-0.5] * len(ids) and deltas[-1].finish_reason == "length"
