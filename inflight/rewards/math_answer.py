"""`math`: the content of the last `\\boxed{...}` (balanced braces) in the response, compared to the
ground truth with `math-verify` (Hugging Face's verifier: `\\frac{1}{2}` equals `0.5`, `1+x^2` equals
`x^2+1`). A response without `\\boxed{}` scores 0.
"""

from __future__ import annotations

import threading
from typing import Any

_BOX_OPENERS = ("\\boxed{", "\\fbox{")


def last_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` (or `\\fbox{...}`) whose braces balance, else None."""
    start = max(text.rfind(opener) + len(opener) if opener in text else -1 for opener in _BOX_OPENERS)
    while start >= 0:
        depth = 1
        for i in range(start, len(text)):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                return text[start:i]
        # unbalanced: try the box before this one
        earlier = text[: start - 1]
        start = max(earlier.rfind(o) + len(o) if o in earlier else -1 for o in _BOX_OPENERS)
    return None


def _as_latex(ground_truth: str) -> str:
    if "$" in ground_truth or "\\boxed" in ground_truth:
        return ground_truth
    return "\\boxed{" + ground_truth + "}"


def math_reward(response: str, ground_truth: str, **_: Any) -> float:
    """1.0 when math-verify finds the last boxed answer equal to the ground truth, else 0.0."""
    from math_verify import parse, verify

    boxed = last_boxed(response)
    if boxed is None:
        return 0.0
    # math-verify's own timeouts use signal.alarm, which only works on the main thread; elsewhere the
    # caller bounds the time (environment.reward_timeout_s)
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    gold = parse(_as_latex(str(ground_truth)), parsing_timeout=timeout)
    answer = parse("\\boxed{" + boxed + "}", parsing_timeout=timeout)
    return float(bool(gold) and bool(answer) and verify(gold, answer, timeout_seconds=timeout))
