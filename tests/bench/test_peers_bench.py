"""`inflight bench peers`: TRL's side against the tasks' own rewards and tokenization, the report's
arithmetic, and the whole bench path at toy sizes (TRL's side for real: scripts/test.sh creates
`.venv-trl`; INFLIGHT_SKIP_TRL=1 skips it)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import pytest

from inflight.bench import trl_worker
from inflight.bench.peers_bench import eval_curve, final_evaluation_empty, main, round_order
from inflight.bench.peers_report import spread, summarize, table, time_to_gain
from inflight.bench.rl_bench import bench_config, make_bench_task, run_overrides
from inflight.bench.trl_side import TASK_REWARDS, TrlUnavailable, default_python, hello, trl_settings
from inflight.tasks import AdditionTask, CountUpTask, build_base_model

TRL_PYTHON = default_python()
SKIP_TRL = os.environ.get("INFLIGHT_SKIP_TRL", "0") == "1"
HAS_TRL = os.path.exists(TRL_PYTHON) and not SKIP_TRL


def trl_or_skip() -> None:
    """Skip without TRL's venv, unless scripts/test.sh made it (INFLIGHT_REQUIRE_TRL=1): then its
    absence fails."""
    if HAS_TRL:
        return
    why = ("INFLIGHT_SKIP_TRL=1" if SKIP_TRL else
           f"TRL's venv ({TRL_PYTHON}) is not set up: scripts/trl_venv.sh creates it (scripts/test.sh does, "
           "unless INFLIGHT_SKIP_TRL=1)")
    if os.environ.get("INFLIGHT_REQUIRE_TRL") == "1" and not SKIP_TRL:
        pytest.fail(why)
    pytest.skip(why)


def _responses(task, rng: random.Random) -> list[tuple[object, str]]:
    """(problem, response) pairs: right answers, near misses, run-ons, prefixes, junk and spaces."""
    out = []
    for p in task.eval_problems()[:60]:
        answer = p.answer
        cut = answer[: rng.randint(0, len(answer))]
        out += [(p, answer), (p, f" {answer}\n"), (p, cut), (p, answer + ",1"), (p, answer[::-1]),
                (p, "".join(rng.choice("0123456789,+<= ") for _ in range(rng.randint(0, 12))))]
    return out


@pytest.mark.parametrize(
    "task",
    [AdditionTask(num_train=1, num_eval=60), CountUpTask(num_train=1, num_eval=60)],
    ids=lambda t: t.name,
)
def test_trl_workers_reward_is_the_tasks_own(task):
    reward = trl_worker.REWARDS[TASK_REWARDS[task.name]]
    pairs = _responses(task, random.Random(0))
    assert [reward(r, p.answer) for p, r in pairs] == [task.reward(p, r) for p, r in pairs]
    # partial credit seen
    assert {task.reward(p, r) for p, r in pairs} > {0.0, 1.0} or task.name == "addition"


def test_prompt_ids_check_refuses_a_tokenization_that_differs():
    task = AdditionTask(num_train=1, num_eval=4)
    rows = [{"prompt": p.prompt, "prompt_ids": task.encode_prompt(p.prompt)} for p in task.eval_problems()]
    ids = task.tokenizer(text=[r["prompt"] for r in rows])["input_ids"]  # what TRL does with text prompts
    trl_worker.check_prompt_ids(ids, rows)  # the same tokenizer: the same ids
    rows[1]["prompt_ids"] = rows[1]["prompt_ids"][1:]
    with pytest.raises(ValueError, match="would not train on the same prompts"):
        trl_worker.check_prompt_ids(ids, rows)


def test_time_to_gain_spread_and_ratios_against_trl():
    curve = [[0.0, 0.30], [5.0, 0.38], [10.0, 0.41], [20.0, 0.56], [30.0, 0.50]]
    assert time_to_gain(curve, 0.30, 10) == 10.0  # 0.40 reached at 10 s (0.41), not 5 s (0.38)
    assert time_to_gain(curve, 0.30, 25) == 20.0
    assert time_to_gain(curve, 0.30, 30) is None
    assert spread([4.0, None, 8.0]) == {"mean": 6.0, "min": 4.0, "max": 8.0, "reached": 2, "runs": 3}

    def row(curve, sps, after):
        return {
            "curve": curve,
            "before": curve[0][1],
            "after": after,
            "samples_per_s": sps,
            "eval_problems": 200,
            "cores_busy": 1.0,
        }

    results = {"trl": [row([[0, 0.3], [30, 0.4], [60, 0.55]], 600, 0.55)],
               "fully_async": [row([[0, 0.3], [10, 0.4], [20, 0.56]], 900, 0.60)]}
    summary = summarize(results, [10, 25])
    vs = summary["fully_async"]["vs_trl"]
    assert vs["times_faster_to_gain"] == {"10": 3.0, "25": 3.0}
    assert vs["samples_per_s"] == pytest.approx(1.5)
    assert vs["after_minus_trl"] == pytest.approx(0.05)
    assert vs["after_difference_standard_error"] == pytest.approx(((0.6 * 0.4 + 0.55 * 0.45) / 200) ** 0.5)
    assert "vs_trl" not in summary["trl"]


def test_round_order_rotates_and_eval_curve_sorts():
    sides = ["trl", "sync", "fully_async"]
    assert [round_order(sides, r) for r in range(3)] == [sides, sides[1:] + sides[:1], sides[2:] + sides[:2]]
    records = [
        {"time": 5.0, "eval/accuracy": 0.5},
        {"time": 0.0, "eval/accuracy": 0.25},
        {"time": 2.0, "reward": 1},
    ]
    assert eval_curve(records) == [[0.0, 0.25], [5.0, 0.5]]
    assert not final_evaluation_empty(records)
    aborted = [*records, {"time": 9.0, "eval/accuracy": 0.0, "eval/addition/response_length": 0.0}]
    assert final_evaluation_empty(aborted)


def test_settings_come_from_the_resolved_config_and_unalignable_ones_are_refused(tmp_path):
    overrides = run_overrides("count_up", 5, 3, ["job.num_train=8", "job.num_eval=4"])
    cfg, job = bench_config(overrides)
    task = make_bench_task(cfg, job)
    settings = trl_settings(cfg, task, "model-dir", tmp_path, 5.0, 2)
    assert settings["max_tokens"] == min(
        cfg.generator.sampling_params.max_generate_length, task.max_new_tokens
    )
    assert (settings["reward"], settings["eval_interval"], settings["seconds"]) == ("prefix_credit", 3, 5.0)
    rows = [json.loads(line) for line in (tmp_path / "train.jsonl").read_text().splitlines()]
    assert [r["answer"] for r in rows] == [p.answer for p in task.train_problems()]
    assert rows[0]["prompt_ids"] == task.encode_prompt(rows[0]["prompt"])
    cfg, job = bench_config([*overrides, "trainer.algorithm.use_kl_loss=true"])
    with pytest.raises(ValueError, match="trainer.algorithm.use_kl_loss"):
        trl_settings(cfg, task, "model-dir", tmp_path, 5.0, 2)


def test_missing_trl_venv_names_the_fix(tmp_path):
    with pytest.raises(TrlUnavailable, match="scripts/trl_venv.sh"):
        hello(str(tmp_path / "bin" / "python"))


def test_the_worker_script_imports_nothing_of_inflight():
    """Run as a script by TRL's venv, which lacks inflight: its rewards load in a bare interpreter."""
    code = ("import runpy, sys; sys.modules['inflight'] = None; "
            f"g = runpy.run_path({trl_worker.__file__!r}); print(g['REWARDS']['exact']('12', '12'))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "1.0"


@pytest.fixture(scope="module")
def toy_model(tmp_path_factory):
    task = AdditionTask(num_train=1)
    return build_base_model(tmp_path_factory.mktemp("peers") / "m", tokenizer=task.tokenizer, hidden_size=32,
                            num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                            intermediate_size=64)


def _bench(tmp_path, model, sides: str) -> dict:
    out = tmp_path / "bench"
    # a budget in work (2 steps a run), the time only a cap: the same runs on a busy machine
    argv = [
        "--model",
        str(model),
        "--steps",
        "2",
        "--seconds",
        "600",
        "--repeats",
        "1",
        "--eval-interval",
        "2",
        "--sides",
        sides,
        "--output-dir",
        str(out),
        "job.num_eval=16",
        "job.num_train=256",
        "job.tensorboard=false",
    ]
    assert main(argv) == 0
    result = json.loads((out / "bench_peers.json").read_text())
    assert (out / "accuracy_vs_time.png").stat().st_size > 0
    assert (out / "bench_peers.md").read_text() == table(result)
    return result


def _check_row(row: dict, steps: int = 2) -> None:
    curve = row["curve"]
    assert curve[0][0] == 0.0 and curve[0][1] == row["before"] and curve[-1][1] == row["after"]
    assert [t for t, _ in curve] == sorted(t for t, _ in curve) and row["steps"] == steps
    assert row["samples_per_s"] > 0 and row["cores_busy"] > 0 and row["eval_problems"] == 16
    assert row["steps"] >= 1 and len(curve) >= 2 + row["steps"] // 2 - 1  # before, every 2 steps, after


def test_bench_peers_smoke_trl_against_sync(tmp_path, toy_model):
    """TRL's side and ours for real (the fully-async side is the same `rl_bench.run_mode` call with
    the mode switched, run by `bench rl`'s smoke test and below when TRL is absent)."""
    trl_or_skip()
    result = _bench(tmp_path, toy_model, "trl,sync")
    assert set(result["results"]) == {"trl", "sync"}
    for rows in result["results"].values():
        _check_row(rows[0])
    (trl,) = result["results"]["trl"]
    settings = trl["settings"]
    # what the inflight run had, read from its resolved config (the default job: 16 prompts x 8)
    assert (settings["prompts_per_step"], settings["group_size"], settings["lr"]) == (16, 8, 1e-4)
    assert (settings["betas"], settings["max_tokens"], settings["reward"]) == ([0.9, 0.99], 6, "exact")
    assert trl["steps"] * 128 == trl["samples"] and trl["threads"] == 2
    assert result["trl"]["trl"] == "1.16.0" and trl["versions"]["trl"] == "1.16.0"
    # the same start weights, evaluated greedily by transformers' generate and by our engine
    (sync,) = result["results"]["sync"]
    assert trl["before"] == pytest.approx(sync["before"], abs=1 / 16 + 1e-9)
    vs = result["summary"]["sync"]["vs_trl"]
    assert vs["samples_per_s"] > 0 and set(vs["times_faster_to_gain"]) == {"10", "25"}
    text = table(result)
    assert result["cpu"] in text and "TRL GRPOTrainer" in text and "Not aligned" in text


def test_bench_peers_smoke_inflight_sides_only(tmp_path, toy_model):
    """Without TRL the bench still runs what it can when asked to (`--sides`), and names the CPU."""
    if HAS_TRL:
        pytest.skip("the TRL smoke run covers the bench path")
    result = _bench(tmp_path, toy_model, "sync,fully_async")
    for rows in result["results"].values():
        _check_row(rows[0])
    assert "vs_trl" not in result["summary"]["sync"] and result["cpu"] in table(result)
