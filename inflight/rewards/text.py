"""Text rules: `exact` (the stripped response equals the ground truth), `contains` (the ground truth
occurs in the response), `regex` (the pattern, the ground truth or extra `pattern`, is found by
`re.search` in the response)."""

from __future__ import annotations

import re
from typing import Any

from inflight.rewards.errors import RewardError


def exact_reward(response: str, ground_truth: str, **_: Any) -> float:
    """1.0 when `response.strip() == ground_truth.strip()`."""
    return float(response.strip() == str(ground_truth).strip())


def contains_reward(response: str, ground_truth: str, **_: Any) -> float:
    """1.0 when the stripped ground truth occurs in the response."""
    return float(str(ground_truth).strip() in response)


def regex_reward(response: str, ground_truth: str, pattern: str | None = None, **_: Any) -> float:
    """1.0 when `re.search(pattern, response)` matches; `pattern` defaults to the ground truth."""
    pattern = str(ground_truth) if pattern is None else pattern
    try:
        compiled = re.compile(pattern)
    except re.error as err:
        raise RewardError(f"regex reward: {pattern!r} is not a valid regular expression ({err})") from err
    return float(compiled.search(response) is not None)
