"""The `inflight` command line: each benchmark's --help is its own parser's; `inflight train` refuses at
once, and `--print-config` validates without torch and exits non-zero for what a run would refuse."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from inflight.cli import main


@pytest.mark.parametrize(
    "what, option", [("engine", "--against"), ("rl", "--task"), ("serve", "--concurrency")]
)
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


ROOT = Path(__file__).resolve().parents[1]
NO_TORCH = (
    "import sys\nfrom inflight.cli import main\nrc = main(sys.argv[1:])\n"
    "print('torch imported:', 'torch' in sys.modules)\nsys.exit(rc)"
)


def _data_config(tmp_path: Path) -> list[str]:
    """A run on your data whose model directory and data files exist (the model's config is all
    `--print-config` reads of it)."""
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    (tmp_path / "rows.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n')
    return [f"trainer.policy.model.path={tmp_path / 'model'}", f"data.train_data=[{tmp_path / 'rows.jsonl'}]",
            f"data.val_data=[{tmp_path / 'rows.jsonl'}]"]


@pytest.mark.parametrize("config", ["demo", "data"])
def test_print_config_of_a_valid_config_exits_0_without_importing_torch(config, tmp_path):
    """Issue 40: validating a config imported torch and the engine (8-12 s)."""
    args = (
        ["--config", str(ROOT / "examples" / "default.yaml")] if config == "demo" else _data_config(tmp_path)
    )
    env = {**os.environ, "INFLIGHT_VLLM_PYTHON": sys.executable}  # SkyRL's default backend is vLLM
    done = subprocess.run([sys.executable, "-c", NO_TORCH, "train", "--print-config", *args], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "trainer:" in done.stdout and "torch imported: False" in done.stdout


def test_print_config_exits_non_zero_listing_every_reason_a_run_would_refuse(capsys):
    """Issue 40: it exited 0 for a policy loss a run refuses, and said nothing of the missing model."""
    from inflight.train.main import main as train_main

    assert train_main(["--print-config", "trainer.algorithm.policy_loss_type=nonsense"]) == 2
    out, err = capsys.readouterr()
    assert "policy_loss_type: nonsense" in out  # the resolved config is still printed
    assert "a run would refuse this config" in err and "Traceback" not in err
    for key in ("trainer.algorithm.policy_loss_type='nonsense'", "trainer.policy.model.path=None",
                "data.train_data=", "data.val_data="):
        assert key in err


def test_print_config_names_a_missing_model_directory(tmp_path, capsys):
    from inflight.train.main import main as train_main

    args = _data_config(tmp_path)
    args[0] = f"trainer.policy.model.path={tmp_path / 'nowhere'}"
    assert train_main(["--print-config", "generator.inference_engine.backend=native", *args]) == 2
    err = capsys.readouterr().err
    assert (
        "(1 reason)" in err
        and f"trainer.policy.model.path='{tmp_path / 'nowhere'}': has no config.json" in err
    )


@pytest.mark.parametrize("print_config", [True, False])
def test_a_vllm_run_without_vllms_venv_is_refused_at_once_naming_the_key_and_the_fix(
        print_config, tmp_path, monkeypatch, capsys):
    """Issue 40: backend=vllm without vLLM's venv passed validation and failed 40 s later in a
    40-line traceback."""
    monkeypatch.setenv("INFLIGHT_VLLM_PYTHON", str(tmp_path / "no-venv" / "bin" / "python"))
    args = [
        *_data_config(tmp_path),
        "generator.inference_engine.backend=vllm",
        f"job.output_dir={tmp_path / 'out'}",
    ]
    assert main(["train", *(["--print-config"] if print_config else []), *args]) == 2
    err = capsys.readouterr().err
    assert "(1 reason)" in err and "Traceback" not in err
    assert "generator.inference_engine.backend='vllm': needs vLLM's python" in err
    assert f"VLLM_VENV={tmp_path / 'no-venv'} scripts/vllm_venv.sh" in err
    assert not (tmp_path / "out").exists()  # refused before anything was built


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    """A tiny Qwen2 with a BPE tokenizer and a chat template, 128 positions."""
    from inflight.testing import make_tiny_model

    return make_tiny_model(
        tmp_path_factory.mktemp("chat-model"), "qwen2", seed=0, max_position_embeddings=128
    )


def _rows(path: Path, answers: list[str]) -> Path:
    path.write_text("".join(json.dumps({"prompt": f"What is {i} + 1?", "answer": a}) + "\n"
                            for i, a in enumerate(answers)))
    return path


def _run(model: Path, tmp_path: Path, *extra: str) -> list[str]:
    from inflight.testing import LOCAL_CPU

    rows = _rows(tmp_path / "rows.jsonl", [str(i + 1) for i in range(4)])
    return [
        *LOCAL_CPU,
        f"trainer.policy.model.path={model}",
        f"data.train_data=[{rows}]",
        f"data.val_data=[{rows}]",
        "trainer.train_batch_size=2",
        "trainer.policy_mini_batch_size=2",
        "trainer.fully_async.num_parallel_generation_workers=2",
        "generator.n_samples_per_prompt=2",
        "generator.sampling_params.max_generate_length=6",
        "generator.inference_engine.weight_sync_backend=inprocess",
        "trainer.max_prompt_length=40",
        "job.max_steps=1",
        "job.plot=false",
        "job.progress=false",
        *extra,
    ]


def test_a_run_says_what_it_did_in_whole_lines(chat_model, tmp_path, capsys):
    """Issue 40: eval_interval=-1 was reported as 0, the TensorBoard folder was named with TensorBoard
    off, and lines were cut at 80 columns in a file."""
    from inflight.train.main import main as train_main

    out = tmp_path / ("an-output-directory-whose-name-alone-is-longer-than-eighty-columns-of-a-terminal-" * 2)
    assert train_main(_run(chat_model, tmp_path, "trainer.eval_interval=-1", "trainer.logger=[console]",
                           f"job.output_dir={out}")) == 0
    lines = capsys.readouterr().out.splitlines()
    assert any(line.startswith("no evaluation (trainer.eval_interval=-1); 1 ") for line in lines)
    assert lines[-1] == f"metrics: {out / 'metrics.jsonl'}"  # whole, and no tensorboard: it is off
    assert not (out / "tensorboard").exists()


@pytest.mark.parametrize("overrides, tensorboard", [
    ([], True), (["job.tensorboard=false"], False), (["trainer.logger=[console,wandb]"], False)])
def test_the_tensorboard_folder_is_named_only_when_tensorboard_is_on(overrides, tensorboard, tmp_path):
    from inflight.tracking.run_logs import tracker_names, where_logged
    from inflight.train.main import resolve_config

    cfg, job = resolve_config(
        None, ["trainer.logger=[console,tensorboard]", f"job.output_dir={tmp_path}", *overrides]
    )
    assert ("tensorboard" in tracker_names(cfg, job)) is tensorboard
    assert (f"tensorboard: {tmp_path / 'tensorboard'}" in where_logged(cfg, job)) is tensorboard


def test_an_agent_run_names_the_agent_as_what_scores_its_episodes(chat_model, tmp_path):
    """Issue 40: an agent run printed `rewards: gsm8k` (the agent's reward scores its episodes)."""
    from inflight.tasks.dataset import DatasetError
    from inflight.train.main import make_task, resolve_config

    rows = _rows(tmp_path / "capitals.jsonl", ["Paris", "Rome"])
    base = [f"trainer.policy.model.path={chat_model}", f"data.train_data=[{rows}]", f"data.val_data=[{rows}]"]
    task = make_task(*resolve_config(None, [*base, "generator.agent.path=my_agents:weather"]))
    assert "rewards: your agent (my_agents:weather) x4" in task.report.summary()
    with pytest.raises(DatasetError, match=r"2 of 2 rows are scored by gsm8k .* Set environment.env_class"):
        make_task(*resolve_config(None, base))  # without the agent, gsm8k would score them: never 1
    assert (
        "rewards: exact x4"
        in make_task(*resolve_config(None, [*base, "environment.env_class=exact"])).report.summary()
    )


def test_a_checkpoint_of_another_runs_data_is_refused_in_one_line_naming_both_fixes(
    chat_model, tmp_path, capsys
):
    """Issue 40: with SkyRL's defaults (one ckpt_path, resume_mode=latest) a second run on other data
    found the first run's checkpoint and died in a traceback."""
    ckpts = tmp_path / "ckpts"
    keys = [f"trainer.ckpt_path={ckpts}", "trainer.resume_mode=latest", "trainer.ckpt_interval=1",
            "trainer.eval_interval=-1", "trainer.logger=[console]"]
    first = tmp_path / "first"
    first.mkdir()
    assert main(["train", *_run(chat_model, first, *keys, f"job.output_dir={first / 'out'}")]) == 0
    assert (ckpts / "latest").read_text() == "global_step_1"
    capsys.readouterr()
    other = tmp_path / "other"
    other.mkdir()
    _rows(other / "more.jsonl", [str(i) for i in range(6)])
    args = _run(chat_model, other, *keys, f"data.train_data=[{other / 'more.jsonl'}]",
                f"job.output_dir={other / 'out'}")
    assert main(["train", *args]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert err.startswith(
        f"error: trainer.ckpt_path='{ckpts}': holds global_step_1 (step 1), a run on other data"
    )
    assert "give this run a trainer.ckpt_path of its own, or set trainer.resume_mode=none" in err
    assert not (other / "out" / "metrics.jsonl").exists()  # refused before anything trained
    assert main(["train", *args, "trainer.resume_mode=none", "trainer.ckpt_interval=-1"]) == 0  # the fix


def test_options_may_sit_among_the_overrides(capsys):
    """`inflight train --config X key=v --print-config key=v` (what scripts/run.sh passes on): argparse
    refused the overrides after the option as unrecognized arguments."""
    from inflight.train.main import main as train_main

    args = [
        "--config",
        str(ROOT / "examples" / "default.yaml"),
        "trainer.seed=5",
        "--print-config",
        "job.threads=1",
    ]
    assert train_main(args) == 0
    out = capsys.readouterr().out
    assert "seed: 5" in out and "threads: 1" in out
