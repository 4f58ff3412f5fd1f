"""pass@k against a hand-computed table, a brute-force enumeration of k-subsets, and exact binomials."""

from __future__ import annotations

import itertools
import math
from fractions import Fraction

import pytest

from inflight.eval.passk import mean_pass_at_k, pass_at_k, report_ks

# n = 4 samples, c correct: P(some correct among k drawn without replacement), worked out by hand
# from 1 - C(4-c, k) / C(4, k): e.g. c=1, k=2: 1 - C(3,2)/C(4,2) = 1 - 3/6.
HAND_N4 = {
    0: {1: Fraction(0), 2: Fraction(0), 4: Fraction(0)},
    1: {1: Fraction(1, 4), 2: Fraction(1, 2), 4: Fraction(1)},
    2: {1: Fraction(1, 2), 2: Fraction(5, 6), 4: Fraction(1)},
    3: {1: Fraction(3, 4), 2: Fraction(1), 4: Fraction(1)},
    4: {1: Fraction(1), 2: Fraction(1), 4: Fraction(1)},
}


@pytest.mark.parametrize("c", range(5))
@pytest.mark.parametrize("k", [1, 2, 4])
def test_hand_computed_table(c, k):
    assert pass_at_k(4, c, k) == pytest.approx(float(HAND_N4[c][k]), abs=1e-15)


@pytest.mark.parametrize("n", range(1, 8))
def test_brute_force_over_subsets(n):
    """Every placement of c correct samples among n, every k: the fraction of k-subsets that hold
    a correct sample."""
    for c in range(n + 1):
        correct = set(range(c))
        for k in range(1, n + 1):
            subsets = list(itertools.combinations(range(n), k))
            hits = Fraction(sum(bool(correct & set(s)) for s in subsets), len(subsets))
            assert pass_at_k(n, c, k) == pytest.approx(float(hits), abs=1e-12), (n, c, k)


@pytest.mark.parametrize("n, c, k", [(200, 3, 100), (500, 1, 1), (1000, 17, 64), (1000, 990, 5)])
def test_large_n_matches_exact_binomials(n, c, k):
    """Where C(n, k) overflows a float, the product form still agrees with exact integer arithmetic."""
    exact = 1 - Fraction(math.comb(n - c, k), math.comb(n, k))
    assert pass_at_k(n, c, k) == pytest.approx(float(exact), rel=1e-12, abs=1e-15)


def test_mean_over_problems_and_report_ks():
    assert report_ks(1) == [1] and report_ks(4) == [1, 2, 4] and report_ks(5) == [1, 2, 4, 5]
    assert report_ks(16) == [1, 2, 4, 8, 16] and report_ks(12) == [1, 2, 4, 8, 12]
    means = mean_pass_at_k([0, 1, 2, 4], 4)
    assert list(means) == ["pass@1", "pass@2", "pass@4"]
    assert means["pass@1"] == pytest.approx((0 + 0.25 + 0.5 + 1) / 4)
    assert means["pass@2"] == pytest.approx((0 + 0.5 + 5 / 6 + 1) / 4)
    assert means["pass@4"] == pytest.approx(0.75)


@pytest.mark.parametrize("n, c, k", [(4, 5, 1), (4, -1, 1), (4, 2, 0), (4, 2, 5)])
def test_bad_arguments_name_the_problem(n, c, k):
    with pytest.raises(ValueError, match="pass_at_k: need"):
        pass_at_k(n, c, k)
