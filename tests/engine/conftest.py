"""Fixtures of the engine tests (the shared weight-update helpers are in conftest_weights.py)."""

from __future__ import annotations

import ctypes

import pytest

from inflight.engine import kernels


@pytest.fixture
def lib(kernel_isa: str) -> ctypes.CDLL:
    """The native kernels of each ISA level this CPU runs: a test taking it runs once per level."""
    library = kernels.load(isa=kernel_isa)
    if library is None:
        pytest.skip("native kernels unavailable (no C compiler)")
    assert kernels.loaded_isa(library) == kernel_isa
    return library
