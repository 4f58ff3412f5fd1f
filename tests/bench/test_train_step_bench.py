"""`inflight bench train-step` end to end on a small shape: each mode runs in its own process and
the table names the CPU (the real shape's figures are in docs/benchmarks.md). Two modes keep it short:
the baseline, the full fine-tuning mode that uses every option, and LoRA over a bfloat16 base."""

from __future__ import annotations

import json

from inflight.bench.train_step_bench import main


def test_every_mode_measures_a_step(tmp_path, capsys):
    out = tmp_path / "result.json"
    assert main(["--shape", "small", "--seqs", "2", "--len", "16", "--warmup", "0", "--threads", "1",
                 "--modes", "plain,bf16_gc,lora16_bf16", "--logprobs-chunk-size", "5", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [r["mode"] for r in result["results"]] == ["plain", "bf16_gc", "lora16_bf16"]
    for r in result["results"]:
        assert r["seconds_per_step"] > 0 and r["cpu_seconds_per_step"] > 0 and r["peak_rss_mib"] > 0
        assert 0 < r["fraction_of_peak"]
    table = capsys.readouterr().out
    assert result["cpu"] in table and "| bf16_gc |" in table


def test_unknown_mode_is_refused(capsys):
    assert main(["--modes", "fp32,fp8"]) == 2
    assert "unknown mode(s) ['fp8']" in capsys.readouterr().err
