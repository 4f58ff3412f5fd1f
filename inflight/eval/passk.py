"""pass@k: the unbiased estimator of Chen et al. 2021 ("Evaluating Large Language Models Trained on
Code", eq. 1), and the k values a report lists.

With n samples of a problem of which c are correct, the probability that at least one of k samples
drawn without replacement from the n is correct is 1 - C(n-c, k) / C(n, k). It is computed as the
product prod_{i=n-c+1}^{n} (1 - k / i) (the paper's numerically stable form), never with the
binomials themselves, which overflow a float for n in the hundreds.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one problem with `n` samples, `c` of them correct (0 <= c <= n, 1 <= k <= n)."""
    if not 0 <= c <= n:
        raise ValueError(f"pass_at_k: need 0 <= c <= n, got n={n}, c={c}")
    if not 1 <= k <= n:
        raise ValueError(f"pass_at_k: need 1 <= k <= n, got n={n}, k={k} (k samples are drawn from the n)")
    if n - c < k:  # every k-subset holds a correct sample
        return 1.0
    failure = 1.0
    for i in range(n - c + 1, n + 1):
        failure *= 1.0 - k / i
    return 1.0 - failure


def report_ks(n: int) -> list[int]:
    """The k values reported for `n` samples: powers of two up to n, and n itself."""
    if n < 1:
        raise ValueError(f"report_ks: n must be >= 1, got {n}")
    ks, k = [], 1
    while k <= n:
        ks.append(k)
        k *= 2
    return ks if ks[-1] == n else [*ks, n]


def mean_pass_at_k(
    correct_counts: Sequence[int], n: int, ks: Iterable[int] | None = None
) -> dict[str, float]:
    """`{"pass@k": mean over problems}` for each k (default `report_ks(n)`), each problem having
    `n` samples of which `correct_counts[i]` are correct."""
    if not correct_counts:
        raise ValueError("mean_pass_at_k: no problems")
    return {f"pass@{k}": sum(pass_at_k(n, c, k) for c in correct_counts) / len(correct_counts)
            for k in (report_ks(n) if ks is None else ks)}
