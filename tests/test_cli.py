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


def test_train_refuses_a_missing_config_file_and_unimplemented_keys_at_once(tmp_path, capsys):
    """rc 2 and one line naming the problem, before any model is built (issue 18, finding 11)."""
    from inflight.train.main import main

    assert main(["--config", str(tmp_path / "nope.yaml")]) == 2
    err = capsys.readouterr().err
    assert "nope.yaml" in err and "the config file does not exist" in err and "Traceback" not in err
    assert main(["generator.inference_engine.tensor_parallel_size=2", f"job.output_dir={tmp_path}"]) == 2
    assert "> 1 is not implemented yet" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())  # nothing was built or written


def test_train_lists_job_and_schema_errors_together_and_checks_devices_first(tmp_path, capsys):
    """Issue 18 finding 11: a bad job. key hid the other errors; an out-of-range seed said only
    'Overflow when unpacking long long'; device=cuda on a CPU-only torch failed 21 s in."""
    import torch

    from inflight.train.main import main

    assert main(["job.max_stepz=3", "trainer.seed=99999999999999999999", f"job.output_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert "2 configuration violations" in err and "job.max_stepz" in err and "trainer.seed" in err
    if not torch.cuda.is_available():
        assert main(["generator.inference_engine.device=cuda", f"job.output_dir={tmp_path}"]) == 2
        err = capsys.readouterr().err
        assert "generator.inference_engine.device=cuda" in err and "use cpu" in err
    assert not any(tmp_path.iterdir())
