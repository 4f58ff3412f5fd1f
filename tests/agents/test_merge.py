"""A session's calls become token-in/token-out samples by their token ids alone."""

from __future__ import annotations

from inflight.agents.merge import merge_calls
from inflight.agents.records import CallRecord
from inflight.rollout.trajectory import ENV_VERSION


def call(index: int, prompt: list[int], output: list[int], version: int = 0) -> CallRecord:
    return CallRecord(
        index, prompt, output, [-0.5 - t for t in range(len(output))], [version] * len(output), "stop"
    )


def test_calls_that_extend_the_previous_one_merge_with_masked_observations():
    first = call(0, [1, 2, 3], [10, 11], version=4)
    second = call(1, [1, 2, 3, 10, 11, 20, 21], [12], version=5)  # 20, 21: the tool result, rendered
    merged = merge_calls([first, second])
    assert merged.new_samples == 0 and len(merged.samples) == 1
    s = merged.samples[0]
    assert s.prompt_ids == [1, 2, 3]
    assert s.response_ids == [10, 11, 20, 21, 12]
    assert s.loss_mask == [1, 1, 0, 0, 1]
    assert s.versions == [4, 4, ENV_VERSION, ENV_VERSION, 5]
    assert s.logprobs == [-0.5, -1.5, 0.0, 0.0, -0.5]
    assert s.calls == [0, 1] and s.tokens == second.prompt_ids + [12]


def test_a_rewritten_history_starts_a_new_sample_and_is_counted():
    first = call(0, [1, 2, 3], [10, 11])
    rewritten = call(1, [1, 2, 9, 10, 11, 20], [12])  # the agent changed a token of its history
    merged = merge_calls([first, rewritten])
    assert merged.new_samples == 1
    assert [s.prompt_ids for s in merged.samples] == [[1, 2, 3], [1, 2, 9, 10, 11, 20]]
    assert merged.samples[1].response_ids == [12] and merged.samples[1].loss_mask == [1]


def test_a_dropped_reply_is_not_an_extension():
    first = call(0, [1, 2, 3], [10, 11])
    dropped = call(1, [1, 2, 3, 20], [12])  # the history lost the model's reply
    assert merge_calls([first, dropped]).new_samples == 1


def test_a_branch_from_a_continued_call_starts_a_sample_and_later_calls_find_their_own():
    root = call(0, [1, 2], [10])
    left = call(1, [1, 2, 10, 30], [11])
    right = call(2, [1, 2, 10, 40], [12])  # the same start, another observation: root already went left
    deeper_left = call(3, [1, 2, 10, 30, 11, 31], [13])
    merged = merge_calls([root, left, right, deeper_left])
    assert merged.new_samples == 1
    assert [s.calls for s in merged.samples] == [[0, 1, 3], [2]]


def test_a_call_with_nothing_between_continues_the_sample():
    merged = merge_calls([call(0, [1], [2]), call(1, [1, 2], [3])])
    assert merged.samples[0].response_ids == [2, 3] and merged.samples[0].loss_mask == [1, 1]
