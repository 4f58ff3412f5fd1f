"""Float comparisons against a reference (transformers, peft) with a tolerance taken from what the
reference itself varies by on the same input, instead of an absolute bound one CPU happens to meet.

The reference is computed once more in another legitimate way (float64 instead of float32, another
torch thread count, a full forward instead of a KV-cached decode): how far those `variants` move
from it is its own rounding on this input and this machine. The code under test may differ from
the reference by a small multiple of that (`factor`), plus a few float32 roundings of the largest
magnitude compared (`ulps`), which keeps the bound meaningful where the variants happen to agree.
Usage: `assert_close_to_reference(got, reference, [variant, ...], what="logprobs")`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import numpy as np
import torch

FACTOR = 4.0
"""How many times the reference's own spread the code under test may differ by."""
ULPS = 8.0
"""Float32 roundings (eps) of the largest magnitude compared, allowed on top of the spread."""
ILL_CONDITIONED = 1e-3
"""A spread above this fraction of the largest magnitude: the input is too close to a discontinuity
(a routing or argmax near-tie) for any tolerance to mean something; refused rather than allowed."""


def _array(x) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.detach().double().cpu().numpy()
    return np.asarray(x, dtype=np.float64)


def spread(reference, variants: Iterable) -> float:
    """The largest difference between the reference and any variant of it (the same quantity
    computed another legitimate way)."""
    ref = _array(reference)
    return max((float(np.abs(_array(v) - ref).max(initial=0.0)) for v in variants), default=0.0)


def tolerance(reference, variants: Iterable, factor: float = FACTOR, ulps: float = ULPS) -> float:
    """The absolute tolerance for comparing against `reference`: `factor` x its spread over
    `variants` + `ulps` float32 roundings of its largest magnitude."""
    ref = _array(reference)
    scale = float(np.abs(ref).max(initial=0.0))
    moved = spread(ref, variants)
    if moved > ILL_CONDITIONED * max(scale, 1.0):
        raise AssertionError(
            f"the reference itself moves by {moved:.3g} (largest magnitude {scale:.3g}) between "
            "ways of computing it: the input is ill-conditioned, choose another"
        )
    return factor * moved + ulps * float(np.finfo(np.float32).eps) * scale


def assert_close_to_reference(got, reference, variants: Iterable, what: str = "",
                              factor: float = FACTOR, ulps: float = ULPS) -> float:
    """`got` within `tolerance(reference, variants)` of `reference` everywhere; returns that tolerance."""
    variants = list(variants)
    ref, out = _array(reference), _array(got)
    atol = tolerance(ref, variants, factor, ulps)
    assert out.shape == ref.shape, f"{what}: shape {out.shape} != the reference's {ref.shape}"
    worst = float(np.abs(out - ref).max(initial=0.0))
    assert worst <= atol, (
        f"{what}: off the reference by {worst:.4g}, allowed {atol:.4g} ({factor:g} x the "
        f"reference's own spread {spread(ref, variants):.3g} + {ulps:g} float32 eps of its "
        f"magnitude {np.abs(ref).max(initial=0.0):.3g})"
    )
    return atol


@contextlib.contextmanager
def other_thread_count() -> Iterator[int]:
    """torch on another thread count for the duration (1 if it runs on more, else 2): its reductions
    split another way, a variant of any reference computed inside."""
    before = torch.get_num_threads()
    other = 1 if before > 1 else 2
    torch.set_num_threads(other)
    try:
        yield other
    finally:
        torch.set_num_threads(before)
