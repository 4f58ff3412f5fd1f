"""The engine benchmark runs end to end in its smallest form and reports sane fields (no timing checks)."""

import json

from inflight.bench.engine_bench import main


def test_engine_bench_small(tmp_path, capsys):
    out = tmp_path / "bench.json"
    argv = "--small --requests 4 --min-len 4 --max-len 10 --repeats 1 --max-rounds 1 --hf-batch-sizes 4 --threads 1".split()
    argv += ["--out", str(out), "--allow-noisy", "--block-size", "8"]  # a shared test machine is rarely quiet
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "speedup" in printed and "KV block size 8 on every side" in printed
    result = json.loads(out.read_text())
    engine, hf = result["engine"], result["transformers"]
    expected = result["workload"]["output_tokens"]
    assert engine["output_tokens"] == hf["output_tokens"] == expected
    assert hf["generated_tokens"] >= expected
    for side in (engine, hf):
        for key in ("median_s", "output_tok_per_s", "flops_per_s", "fraction_of_peak", "peak_rss_mib"):
            assert side[key] > 0, key
    assert engine["startup_s"] > 0 and engine["params"] > 0 and engine["warmup_s"] > 0
    assert engine["prefix_cache_hit_tokens"] == 0 and engine["block_size"] == 8
    assert len(engine["idle_sides_cores"]) == len(engine["other_cores"]) == 1
    assert result["machine"]["matmul_peak_flops"] > 0 and result["speedup"] > 0
    assert 0.0 <= result["greedy_agreement"] <= 1.0
