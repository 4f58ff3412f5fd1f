"""The gsm8k rule on hand-written responses: strict `#### <number>` (last one), flexible last number."""

from __future__ import annotations

import pytest

from inflight.rewards import extract_gsm8k_answer, get_reward, gsm8k_ground_truth


@pytest.mark.parametrize(
    "response, truth, strict, flexible",
    [
        ("She has 3 + 4 = 7 apples.\n#### 7", "7", 1.0, 1.0),
        ("#### $1,000", "1000", 1.0, 1.0),  # `$` and `,` stripped
        ("#### 1,000.00", "1000", 1.0, 1.0),  # compared as numbers, not strings
        ("#### 72.", "72", 1.0, 1.0),  # a sentence's full stop is no decimal point
        ("#### -5", "-5", 1.0, 1.0),
        ("#### 5 no wait #### 6", "6", 1.0, 1.0),  # the last `####` counts
        ("#### 5 no wait #### 6", "5", 0.0, 0.0),
        ("The answer is 54.", "54", 0.0, 1.0),  # strict needs `####`; flexible takes the last number
        ("#### 54 (I used 3 steps)", "54", 1.0, 0.0),  # flexible: the last number is 3
        ("no number here", "3", 0.0, 0.0),
        ("#### 8", "#### 8", 1.0, 1.0),  # a whole GSM8K answer as ground truth
        ("#### 0.5", "1/2", 1.0, 1.0),
    ],
)
def test_strict_and_flexible(response, truth, strict, flexible):
    assert get_reward("gsm8k")(response, truth) == strict
    assert get_reward("gsm8k_flexible")(response, truth) == flexible
    assert get_reward("gsm8k")(response, truth, method="flexible") == flexible


def test_extraction_and_ground_truth():
    assert extract_gsm8k_answer("x #### $1,234.5 y") == "$1,234.5"
    assert extract_gsm8k_answer("no marker 12") is None
    assert extract_gsm8k_answer("a 1 b 2.", "flexible") == "2"
    assert gsm8k_ground_truth("Natalia sold 48/2 = 24 clips.\n#### 72") == "72"
    with pytest.raises(ValueError, match="strict' or 'flexible"):
        extract_gsm8k_answer("#### 1", "loose")


def test_extra_info_keys_are_ignored():
    assert get_reward("gsm8k")("#### 3", "3", split="train", index=7, question="?") == 1.0
