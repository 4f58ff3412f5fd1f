"""`inflight bench engine --latency`: per-step decode latency from a 1-token and an n-token decode."""

from __future__ import annotations

import json

import pytest

from inflight.bench import engine_bench
from inflight.bench.engine_sides import per_step_s
from inflight.bench.latency import PROMPT_LEN, format_latency, latency_workload


def test_the_prefill_and_first_token_drop_out():
    # prefill + first token 0.05 s, then 9 decode steps of 0.01 s
    assert per_step_s(0.05, 0.05 + 9 * 0.01, 10) == pytest.approx(0.01)


def test_the_workload_is_one_batch_of_equal_length_prompts():
    cfg, _ = engine_bench._parse(["--small"])
    work = latency_workload(cfg, 8, 50)
    assert [len(p) for p in work.prompts] == [PROMPT_LEN] * 8 and work.output_lens == [50] * 8
    assert len({tuple(p) for p in work.prompts}) == 8  # distinct: no prefix shared between them


def test_engine_latency_small(tmp_path, capsys):
    out = tmp_path / "latency.json"
    argv = ["--small", "--latency", "--latency-batches", "1,4", "--latency-steps", "6", "--repeats", "1",
            "--threads", "1", "--against", "transformers", "--out", str(out)]
    assert engine_bench.main(argv) == 0
    result = json.loads(out.read_text())
    assert set(result["per_step_s"]) == {"1", "4"}
    for row in result["per_step_s"].values():
        assert set(row) == {"engine"} and row["engine"] > 0  # transformers has no per-step decode here
    assert result["cpu"] and "mean_other_cores" in result["other_load"]
    table = capsys.readouterr().out
    assert "engine ms/step" in table and result["cpu"] in format_latency(result, result["cpu"])
