"""`inflight bench serve` runs end to end in its smallest form and reports both sides."""

from __future__ import annotations

import json

import pytest

from inflight.bench.serve_bench import Trace, format_table, main, summarize


def test_summarize_counts_chunked_tokens_as_equal_gaps():
    trace = Trace(start=0.0, arrivals=[(0.010, 1), (0.012, 1), (0.018, 3)], tokens=[1, 2, 3, 4, 5])
    s = summarize([trace], wall_s=0.02)
    assert s["ttft_ms_p50"] == pytest.approx(10.0) and s["latency_ms_p50"] == pytest.approx(18.0)
    assert s["itl_ms_p50"] == pytest.approx(2.0) and s["itl_ms_p99"] == pytest.approx(2.0)
    assert s["output_tokens_per_s"] == pytest.approx(250.0) and s["requests_per_s"] == pytest.approx(50.0)


def test_serve_bench_smoke(tmp_path, capsys):
    out = tmp_path / "serve.json"
    code = main(["--small", "--requests", "6", "--concurrency", "3", "--prompt-len", "8", "--max-tokens", "6",
                 "--model-dir", str(tmp_path / "model"), "--out", str(out)])
    assert code == 0
    result = json.loads(out.read_text())
    for path in ("stream", "generate"):
        r = result["paths"][path]
        assert r["all_complete"] and r["same_tokens_fraction"] > 0.5
        for side in ("inprocess", "server"):
            assert r[side]["requests_per_s"] > 0 and r[side]["latency_ms_p50"] > 0
        assert r["overhead"]["requests_per_s"] > 0
    assert result["paths"]["stream"]["server"]["itl_ms_p50"] > 0
    assert "overhead" in capsys.readouterr().out and "overhead" in format_table(result)
