"""`inflight eval` end to end on a tiny model: JSONL and SkyRL-format parquet (written with `datasets`),
files and keys, pass@k recomputed from the sample dump with exact binomials, a seeded second run
writing identical files, and a real `inflight serve` on 127.0.0.1 giving the same samples."""

from __future__ import annotations

import json
import math
from fractions import Fraction
from pathlib import Path

import datasets
import pytest

from inflight.cli import main as inflight_main
from inflight.engine import EngineConfig
from inflight.server.launch import serve_model

N = 4


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory):
    return tiny_model_factory("qwen2")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """A flat JSONL set (text prompts, scored by --env-class contains) and a SkyRL-format parquet set
    (chat prompts, per-row env_class and reward_spec). A random model's text contains a common
    letter in some samples and not in others, so pass@k is neither 0 nor 1."""
    root = tmp_path_factory.mktemp("eval-data")
    flat = root / "letters.jsonl"
    flat.write_text("".join(json.dumps({"prompt": f"say {c}", "answer": c}) + "\n" for c in "eatoin"))
    skyrl = root / "chat.parquet"
    rows = [{"prompt": [{"role": "user", "content": f"spell {w}"}], "env_class": "contains",
             "reward_spec": {"method": "rule", "ground_truth": w[0]}, "data_source": "letters",
             "extra_info": {"index": i}} for i, w in enumerate(["echo", "alpha", "tango", "oscar", "india"])]
    datasets.Dataset.from_list(rows).to_parquet(str(skyrl))
    return [flat, skyrl]


def run_eval(model_dir: Path, data: list[Path], out: Path, *extra: str) -> int:
    args = ["eval", "--model", str(model_dir), "--output", str(out), "--n", str(N), "--temperature", "1.0",
            "--seed", "7", "--max-tokens", "6", "--env-class", "contains", "--no-progress", *extra]
    for path in data:
        args += ["--data", str(path)]
    return inflight_main(args)


def read(out: Path) -> tuple[dict, list[dict]]:
    metrics = json.loads((out / "metrics.json").read_text())
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    return metrics, samples


@pytest.fixture(scope="module")
def first_run(model_dir, data, tmp_path_factory):
    out = tmp_path_factory.mktemp("eval-out") / "run1"
    assert run_eval(model_dir, data, out) == 0
    return out


def test_files_keys_and_pass_at_k_from_the_samples(first_run, data):
    metrics, samples = read(first_run)
    assert list(metrics) == ["letters", "chat"]  # file stems, in --data order
    config = json.loads((first_run / "eval_config.json").read_text())
    assert config["n"] == N and config["seed"] == 7 and config["data"] == [str(p) for p in data]
    for name, size in (("letters", 6), ("chat", 5)):
        m = metrics[name]
        assert m["num_problems"] == size and m["num_samples"] == size * N
        assert {"mean_reward", "pass@1", "pass@2", "pass@4"} <= set(m) and "pass@3" not in m
        assert m["pass@1"] <= m["pass@2"] <= m["pass@4"]
        mine = [s for s in samples if s["data"] == name]
        assert len(mine) == size * N and {s["sample"] for s in mine} == set(range(N))
        assert set(mine[0]) >= {"data", "problem_id", "sample", "prompt", "response", "reward"}
        counts: dict[str, int] = {}
        for s in mine:
            assert s["reward"] in (0.0, 1.0)
            counts[s["problem_id"]] = counts.get(s["problem_id"], 0) + int(s["reward"] >= 1)
        for k in (1, 2, 4):  # 1 - C(n-c, k)/C(n, k) in exact integers (math.comb is 0 when k > n-c)
            exact = sum(1 - Fraction(math.comb(N - c, k), math.comb(N, k)) for c in counts.values()) / size
            assert m[f"pass@{k}"] == pytest.approx(float(exact), abs=1e-12)
        assert m["mean_reward"] == pytest.approx(sum(s["reward"] for s in mine) / len(mine))
    assert 0 < metrics["letters"]["pass@1"] < 1  # the data set does separate samples
    contains = [s for s in samples if s["data"] == "letters"]
    assert all((s["reward"] == 1.0) == (s["prompt"][-1] in s["response"]) for s in contains)


def test_a_seeded_second_run_writes_identical_files(first_run, model_dir, data, tmp_path):
    assert run_eval(model_dir, data, tmp_path / "run2") == 0
    for name in ("metrics.json", "samples.jsonl"):
        assert (tmp_path / "run2" / name).read_bytes() == (first_run / name).read_bytes()
    assert run_eval(model_dir, data, tmp_path / "run3", "--seed", "8") == 0
    assert (tmp_path / "run3" / "samples.jsonl").read_bytes() != (first_run / "samples.jsonl").read_bytes()


def test_through_a_running_server_the_samples_are_the_same(first_run, model_dir, data, tmp_path):
    server = serve_model(EngineConfig(model=str(model_dir), block_size=4), "tiny")
    try:
        assert run_eval(model_dir, data, tmp_path / "remote", "--server", server.url) == 0
    finally:
        server.stop()
    assert (tmp_path / "remote" / "samples.jsonl").read_bytes() == (first_run / "samples.jsonl").read_bytes()
    assert read(tmp_path / "remote")[0] == read(first_run)[0]
    assert json.loads((tmp_path / "remote" / "eval_config.json").read_text())["server"] == [server.url]


def test_bad_arguments_exit_with_a_usage_error(model_dir, data, tmp_path, capsys):
    with pytest.raises(SystemExit) as err:
        run_eval(model_dir, [tmp_path / "missing.jsonl"], tmp_path / "x", "--n", "0")
    assert err.value.code == 2
    text = capsys.readouterr().err
    assert "--n=0 must be >= 1" in text and "no such file or directory" in text and "missing.jsonl" in text
    with pytest.raises(SystemExit):
        inflight_main(["eval", "--model", str(model_dir), "--data", str(data[0]), "--output", str(tmp_path),
                       "--n", "4", "--temperature", "0"])
    assert "identical greedy samples" in capsys.readouterr().err


def test_an_unknown_reward_is_an_error_naming_it(model_dir, data, tmp_path, capsys):
    code = inflight_main(["eval", "--model", str(model_dir), "--data", str(data[0]), "--output",
                          str(tmp_path / "o"), "--env-class", "no_such_reward", "--no-progress"])
    assert code == 2 and "no_such_reward" in capsys.readouterr().err


def test_stop_strings_and_failing_rewards_reach_the_scoring(model_dir, tmp_path, monkeypatch):
    """The reward sees each response cut before the first --stop string; a reward that raises scores
    0 and is counted, naming its error."""
    (tmp_path / "my_rewards.py").write_text(
        "def no_e(response, ground_truth, **extra):\n"
        "    if ground_truth == 'boom':\n"
        "        raise ValueError('no luck')\n"
        "    return float('e' not in response)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    data = tmp_path / "d.jsonl"
    rows = [{"prompt": f"p{i}", "answer": a} for i, a in enumerate("xyz")]
    rows.append({"prompt": "q", "answer": "boom"})
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    assert inflight_main(["eval", "--model", str(model_dir), "--data", str(data), "--output", str(out),
                          "--n", "2", "--max-tokens", "12", "--stop", "e", "--env-class", "my_rewards:no_e",
                          "--no-progress"]) == 0
    metrics, samples = read(out)
    assert metrics["d"]["reward_failures"] == 2
    assert [s["reward"] for s in samples if s["ground_truth"] != "boom"] == [1.0] * 6
    failed = [s for s in samples if s["ground_truth"] == "boom"]
    assert len(failed) == 2 and all("no luck" in s["reward_error"] and s["reward"] == 0.0 for s in failed)
    assert any("e" in s["response"] for s in samples)  # the model did write the stop string
    assert json.loads((out / "eval_config.json").read_text())["stop"] == ["e"]


def test_skyrl_gym_settings_reach_the_environments_and_a_bad_one_is_named():
    from inflight.config import ConfigError
    from inflight.eval.job import gym_config

    gym = gym_config(["text2sql.db_path=/data/sql", "search.topk=5", "max_env_workers=4"])
    assert (gym.text2sql.db_path, gym.search.topk, gym.max_env_workers) == ("/data/sql", 5, 4)
    with pytest.raises(ConfigError) as err:
        gym_config(["text2sql.db_pth=/x"])
    assert err.value.keys == ["environment.skyrl_gym.text2sql.db_pth"] and "db_path" in str(err.value)


def _rows(path: Path, answers: list[str], env_class: str | None = None) -> Path:
    rows = [{"prompt": f"q{i}", "answer": a, **({"env_class": env_class} if env_class else {})}
            for i, a in enumerate(answers)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_training_and_eval_choose_the_reward_of_a_row_alike(model_dir, tmp_path):
    """Issue 40: a plain prompt/answer row was scored by gsm8k in training and by exact in eval."""
    from transformers import AutoTokenizer

    from inflight.eval.cli import build_parser, spec_from_args
    from inflight.eval.job import build_task
    from inflight.testing import LOCAL_CPU
    from inflight.train.main import make_task, resolve_config

    data = _rows(tmp_path / "mixed.jsonl", ["7", "reasoning #### 8", "9"])
    with data.open("a") as f:
        f.write(json.dumps({"prompt": "q3", "answer": "e", "env_class": "contains"}) + "\n")
    args = build_parser().parse_args(["--model", str(model_dir), "--data", str(data)])  # eval's defaults
    evaluated, _ = build_task(spec_from_args(args), AutoTokenizer.from_pretrained(model_dir), 64)
    # training's defaults
    cfg, job = resolve_config(None, [*LOCAL_CPU, f"trainer.policy.model.path={model_dir}",
                                     f"data.train_data=[{data}]", f"data.val_data=[{data}]"])
    trained = make_task(cfg, job)
    assert evaluated.report.rewards == trained.report.rewards == {"gsm8k": 6, "contains": 2}
    for a, b in zip(evaluated.eval_problems(), trained.eval_problems(), strict=True):
        assert evaluated.reward(a, "so #### 7.0") == trained.reward(b, "so #### 7.0")


def test_a_reward_that_can_never_score_a_row_is_refused_in_eval_as_in_training(model_dir, tmp_path, capsys):
    """Issue 40: rows answered 'Paris' under gsm8k could never score 1, and nothing said so."""
    data = _rows(tmp_path / "capitals.jsonl", ["Paris", "Rome", "12"])
    out = tmp_path / "out"
    code = inflight_main(["eval", "--model", str(model_dir), "--data", str(data), "--output", str(out),
                          "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert "2 of 3 rows are scored by gsm8k" in err and "capitals.jsonl:1: 'Paris'" in err
    assert "environment.env_class" in err and "--env-class exact" in err and not out.exists()
    assert inflight_main(["eval", "--model", str(model_dir), "--data", str(data), "--output", str(out),
                          "--env-class", "exact", "--no-progress"]) == 0


def test_the_output_is_a_directory_of_its_own(model_dir, tmp_path, monkeypatch, capsys):
    """Issue 40: --output runs/gsm8k/eval mixed its files into the training run's evaluations."""
    data = _rows(tmp_path / "d.jsonl", ["a", "b"])
    base = [
        "eval",
        "--model",
        str(model_dir),
        "--data",
        str(data),
        "--env-class",
        "contains",
        "--no-progress",
        "--max-tokens",
        "4",
    ]
    training = tmp_path / "run" / "eval"
    (training / "step_10").mkdir(parents=True)
    with pytest.raises(SystemExit):
        inflight_main([*base, "--output", str(training)])
    assert "holds a training run's outputs" in capsys.readouterr().err
    (tmp_path / "run" / "metrics.jsonl").write_text("")
    with pytest.raises(SystemExit):
        inflight_main([*base, "--output", str(tmp_path / "run")])
    assert "holds a training run's outputs" in capsys.readouterr().err
    monkeypatch.chdir(tmp_path)
    assert inflight_main(base) == 0  # the default: runs/inflight-eval, beside a training run's runs/inflight
    assert (tmp_path / "runs" / "inflight-eval" / "metrics.json").is_file()
    with pytest.raises(SystemExit):
        inflight_main(base)
    assert (
        "already holds an evaluation (metrics.json, samples.jsonl, eval_config.json)"
        in capsys.readouterr().err
    )
    assert inflight_main([*base, "--overwrite"]) == 0


def test_console_lines_are_not_cut_at_80_columns_in_a_file(model_dir, tmp_path, capsys):
    """Issue 40: output redirected to a file was hard-wrapped at 80 columns."""
    data = _rows(tmp_path / "d.jsonl", ["a", "b"])
    out = tmp_path / ("a-directory-whose-name-alone-takes-more-than-eighty-columns-of-a-terminal-line-" * 2)
    assert inflight_main(["eval", "--model", str(model_dir), "--data", str(data), "--env-class", "contains",
                          "--no-progress", "--max-tokens", "4", "--output", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert any(
        line.startswith("2 samples in ") and f"results in {out}/ (metrics.json" in line for line in lines
    )
