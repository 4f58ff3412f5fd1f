"""`gsm8k`: SkyRL's GSM8K rule. Strict (default): the number after the last `#### ` in the response;
flexible (`gsm8k_flexible`, or `method="flexible"`): the last number anywhere in the response.

`,` and `$` are stripped and the number is compared numerically to the ground truth, so `#### $1,000`
scores 1 against `1000` and `#### 72.0` against `72` (SkyRL compares the strings and scores both 0).
A ground truth that is a whole GSM8K answer (reasoning, then `#### 72`) is read as what follows `####`.
"""

from __future__ import annotations

import re
from typing import Any

# relative, and nothing but the standard library and numbers.py: `inflight bench peers`' TRL worker loads
# this file by path into TRL's interpreter, which lacks this package (trl_worker.SHARED_REWARDS)
from .numbers import NUMBER, same_number

_STRICT = re.compile(r"####\s*(" + NUMBER.pattern + ")")


def extract_gsm8k_answer(response: str, method: str = "strict") -> str | None:
    """The answer the rule reads from `response` (None when there is none)."""
    if method == "strict":
        found = _STRICT.findall(response)
    elif method == "flexible":
        found = NUMBER.findall(response)
    else:
        raise ValueError(f"gsm8k method={method!r} must be 'strict' or 'flexible'")
    return found[-1] if found else None


def gsm8k_ground_truth(answer: str) -> str:
    """The ground truth of a GSM8K answer: what follows the last `####` (the whole text if none)."""
    return answer.rsplit("####", 1)[-1].strip() if "####" in answer else answer.strip()


def gsm8k_reward(response: str, ground_truth: str, method: str = "strict", **_: Any) -> float:
    """1.0 when the extracted answer equals the ground truth numerically, else 0.0."""
    answer = extract_gsm8k_answer(response, method)
    return float(answer is not None and same_number(answer, gsm8k_ground_truth(str(ground_truth))))


def gsm8k_flexible_reward(response: str, ground_truth: str, **extra: Any) -> float:
    """`gsm8k_reward` with `method="flexible"`: the last number in the response."""
    extra.pop("method", None)
    return gsm8k_reward(response, ground_truth, method="flexible", **extra)
