"""The transport benchmark runs end to end in its smallest form and reports every transport it ran."""

from __future__ import annotations

from inflight.bench.common import MODEL_SHAPES
from inflight.bench.transport_bench import format_table, main, run
from inflight.testing import make_tiny_model


def test_transport_bench_reports_bytes_per_second_and_pause(tmp_path):
    model_dir = make_tiny_model(tmp_path / "m", "qwen2", seed=0, **MODEL_SHAPES["tiny"])
    results = run(str(model_dir), ["inprocess", "shm"], chunk_bytes=64 * 1024, repeats=1, threads=1)
    assert results["memcpy_s"] > 0 and results["weight_bytes"] > 64 * 1024
    assert set(results["transports"]) == {"inprocess", "shm"}
    for r in results["transports"].values():
        assert r["update_s"] > 0 and r["bytes_per_s"] > 0 and r["chunks"] > 1
    assert "shm" in format_table(results)


def test_transport_bench_cli_rejects_unknown_transport(capsys):
    try:
        main(["--transport", "carrier-pigeon"])
    except SystemExit as exit_:
        assert exit_.code == 2
    assert "invalid choice" in capsys.readouterr().err


def test_transport_bench_in_bfloat16_sends_half_the_bytes(tmp_path):
    """`--dtype bfloat16` (the default of `--xl`): weights sent and engines in bfloat16."""
    model_dir = make_tiny_model(tmp_path / "m", "qwen2", seed=0, **MODEL_SHAPES["tiny"])
    fp32 = run(str(model_dir), ["inprocess"], chunk_bytes=64 * 1024, repeats=1, threads=1)
    bf16 = run(str(model_dir), ["shm"], chunk_bytes=64 * 1024, repeats=1, threads=1, dtype="bfloat16")
    assert bf16["weight_bytes"] * 2 == fp32["weight_bytes"] and bf16["params"] == fp32["params"]
    assert "in bfloat16" in format_table(bf16) and bf16["transports"]["shm"]["chunks"] >= 1
