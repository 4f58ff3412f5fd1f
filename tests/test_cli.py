"""The `inflight` command line dispatches each benchmark's --help to that benchmark's own parser."""

from __future__ import annotations

import pytest

from inflight.cli import main


@pytest.mark.parametrize("what, option", [("engine", "--against"), ("rl", "--task"), ("serve", "--concurrency")])
def test_bench_help_is_the_benchmarks_own(what, option, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", what, "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert f"inflight bench {what}" in out and option in out


def test_bench_without_a_name_lists_the_benchmarks(capsys):
    assert main(["bench", "--help"]) == 0
    assert main(["bench"]) == 2
    assert "engine,weight-sync,serve,rl" in capsys.readouterr().out
