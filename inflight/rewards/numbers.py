"""Numbers in model output: what `$1,000`, `-3.5` and `72.` mean, compared exactly (as fractions)."""

from __future__ import annotations

import re
from fractions import Fraction

NUMBER = re.compile(r"-?(?:\$\s*)?(?:\d[\d,]*)?\.?\d+")
"""A signed decimal number, possibly with a `$` sign and `,` thousands separators (`-$1,000.50`)."""


def to_number(text: str) -> Fraction | None:
    """`text` (stripped of `$`, `,` and spaces) as an exact fraction, or None when it is no number."""
    cleaned = text.replace(",", "").replace("$", "").replace(" ", "").strip()
    if cleaned.endswith("."):
        cleaned = cleaned[:-1]
    try:
        return Fraction(cleaned)
    except (ValueError, ZeroDivisionError):
        return None


def same_number(answer: str, ground_truth: str) -> bool:
    """Whether `answer` and `ground_truth` are the same number (`1000` == `1,000.0`); when the
    ground truth is no number, whether the two strings are equal after stripping."""
    want = to_number(ground_truth)
    if want is None:
        return answer.strip() == ground_truth.strip()
    got = to_number(answer)
    return got is not None and got == want
