"""`inflight bench weight-sync --server native`: a sync into a live `inflight serve` while requests
decode, timed pause -> HTTP chunks -> resume, each request spanning the two versions."""

from __future__ import annotations

import json

import pytest

from inflight.bench.server_sync_bench import main

pytestmark = pytest.mark.timeout(180)


def test_a_sync_into_a_native_server_with_requests_in_flight(tmp_path, capsys):
    out = tmp_path / "sync.json"
    assert main(["--server", "native", "--shape", "small", "--requests", "2", "--repeats", "2",
                 "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["requests_spanning_the_sync"] == [2, 2]  # every request saw both versions
    assert len(result["sync_s"]) == 2 and result["bytes"] > 0
    assert "weight sync into a native server (small, float32 on cpu" in capsys.readouterr().out
