"""The weight-sync benchmark runs end to end in its smallest form and reports each fate."""

from __future__ import annotations

from inflight.bench.common import MODEL_SHAPES
from inflight.bench.weight_sync_bench import format_table, run
from inflight.testing import make_tiny_model


def test_weight_sync_bench_reports_every_fate(tmp_path):
    model_dir = make_tiny_model(tmp_path / "m", "qwen2", seed=0, **MODEL_SHAPES["tiny"])
    results = run(str(model_dir), num_requests=3, prompt_len=20, repeats=1)
    assert set(results["fates"]) == {"keep", "offload", "recompute"}
    assert results["memcpy_s"] > 0 and results["weight_bytes"] > 0
    for fate in results["fates"].values():
        assert fate["pause_s"] > 0
    assert results["fates"]["keep"]["recomputed_tokens"] == 0
    assert results["fates"]["offload"]["recomputed_tokens"] == 0
    # recompute re-reads every prompt and the tokens sampled before the update
    assert results["fates"]["recompute"]["recomputed_tokens"] >= 3 * 20
    assert "recompute" in format_table(results)
