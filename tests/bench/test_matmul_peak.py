"""The matmul peak picks its product's size from a timed 256 product: 2048 where the dtype is native,
smaller where a 2048 product would take minutes (bfloat16 without AVX-512)."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest
import torch

from inflight.bench import matmul_peak


@pytest.mark.parametrize(("probe_s", "expected"), [(0.0002, 2048), (0.003, 1024), (0.02, 512), (2.0, 256)])
def test_the_size_is_the_largest_whose_product_fits_the_budget(monkeypatch, probe_s, expected):
    monkeypatch.setattr(matmul_peak, "_seconds", lambda a, b, out: probe_s * (a.shape[0] / 256) ** 3)
    assert matmul_peak.pick_size(torch.float32, budget_s=1.0) == expected


def test_max_n_caps_the_size(monkeypatch):
    monkeypatch.setattr(matmul_peak, "_seconds", lambda a, b, out: 1e-6)
    assert matmul_peak.pick_size(torch.float32, max_n=512) == 512


def test_the_peak_is_measured_at_the_picked_size(monkeypatch):
    sizes = []
    real = matmul_peak._seconds
    monkeypatch.setattr(matmul_peak, "pick_size", lambda dtype, max_n, budget_s: 256)
    monkeypatch.setattr(
        matmul_peak, "_seconds", lambda a, b, out: sizes.append(a.shape[0]) or real(a, b, out)
    )
    assert matmul_peak.matmul_peak_flops(torch.bfloat16, repeats=2) > 0
    assert sizes == [256, 256]


def test_the_vllm_worker_measures_the_same_peak_without_inflight():
    worker = runpy.run_path(str(Path(matmul_peak.__file__).with_name("vllm_worker.py")))
    assert worker["_matmul_peak"]("float32") > 0
