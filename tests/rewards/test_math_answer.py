"""The math rule: the last balanced `\\boxed{}`, judged by math-verify (the reference verifier)."""

from __future__ import annotations

import pytest
from math_verify import parse, verify

from inflight.rewards import get_reward, last_boxed


@pytest.mark.parametrize(
    "text, content",
    [
        ("so \\boxed{42}.", "42"),
        ("\\boxed{1} then \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),  # the last one
        ("\\boxed{\\frac{a^{2}}{b_{1}}}", "\\frac{a^{2}}{b_{1}}"),  # nested braces
        ("\\boxed{x} and \\boxed{broken", "x"),  # unbalanced last box: the one before
        ("\\fbox{7}", "7"),
        ("no box", None),
    ],
)
def test_last_boxed(text, content):
    assert last_boxed(text) == content


@pytest.mark.parametrize(
    "response, truth",
    [
        ("The answer is \\boxed{\\frac{1}{2}}", "0.5"),
        ("\\boxed{0.5}", "\\frac{1}{2}"),
        ("\\boxed{1+x^2}", "x^2+1"),
        ("\\boxed{\\sqrt{2}}", "$2^{1/2}$"),
        ("\\boxed{3}", "4"),
        ("\\boxed{\\{1,2\\}}", "\\{2,1\\}"),
    ],
)
def test_math_agrees_with_math_verify(response, truth):
    boxed = last_boxed(response)
    gold = truth if "$" in truth else f"${truth}$"
    expected = float(verify(parse(gold), parse(f"${boxed}$")))
    assert get_reward("math")(response, truth) == expected


def test_math_cases_by_hand():
    math = get_reward("math")
    assert math("so \\boxed{\\frac{1}{2}}", "0.5") == 1.0
    assert math("\\boxed{\\frac{2}{4}}", "\\frac{1}{2}") == 1.0
    assert math("1/2", "0.5") == 0.0  # no box, no score
    assert math("\\boxed{3}", "4") == 0.0


def test_math_off_the_main_thread():
    """math-verify's own timeout needs the main thread; off it the reward still answers."""
    import threading

    out = []
    thread = threading.Thread(target=lambda: out.append(get_reward("math")("\\boxed{0.5}", "1/2")))
    thread.start()
    thread.join()
    assert out == [1.0]
