"""`inflight bench rl`: core pinning, CPU accounting, the summary, and a smoke run on a tiny budget."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from inflight.bench.rl_bench import (
    CorePinning,
    CpuMeter,
    _say_accuracy,
    _time_to,
    accuracy_gap,
    bench_config,
    build_parser,
    children_of,
    main,
    overlap_bound,
    phase_seconds,
    record_response_lengths,
    run_overrides,
    say_time_capped,
    summarize,
    training_threads,
)
from inflight.tasks import CountUpTask, build_base_model
from inflight.tasks.count_up import make_problem
from inflight.train.policy import TRAIN_THREAD_NAME

TWO_CORES = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two allowed cores")


def _wait_for(condition, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return False


@TWO_CORES
def test_core_pinning_process_puts_this_process_and_its_children_apart():
    before = os.sched_getaffinity(0)
    with CorePinning(True, interval_s=0.05, placement="process") as pinning:
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
        try:
            assert child.pid in children_of(os.getpid())
            assert os.sched_getaffinity(0) == pinning.trainer_cores
            assert _wait_for(lambda: os.sched_getaffinity(child.pid) == pinning.engine_cores)
            assert pinning.trainer_cores.isdisjoint(pinning.engine_cores)
            assert pinning.describe() == {
                "trainer": sorted(pinning.trainer_cores),
                "engine": sorted(pinning.engine_cores),
                "placement": "process",
            }
        finally:
            child.kill()
            child.wait()
    assert os.sched_getaffinity(0) == before


@TWO_CORES
def test_core_pinning_training_thread_gives_the_policys_training_thread_its_own_core():
    """The LocalPolicy's training steps run on its named thread; the placement moves that thread
    (born on the engine's core, like every thread of this process) to the trainer's core."""
    before = os.sched_getaffinity(0)
    with CorePinning(True, interval_s=0.05) as pinning:
        assert pinning.describe()["placement"] == "training-thread"
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=TRAIN_THREAD_NAME)
        try:
            assert os.sched_getaffinity(0) == pinning.engine_cores  # the rollout loop's thread
            assert pool.submit(threading.get_native_id).result() in training_threads()
            assert _wait_for(lambda: pool.submit(os.sched_getaffinity, 0).result() == pinning.trainer_cores)
            assert _wait_for(lambda: os.sched_getaffinity(child.pid) == pinning.engine_cores)
            other = ThreadPoolExecutor(max_workers=1, thread_name_prefix="something-else")
            time.sleep(0.2)
            assert other.submit(os.sched_getaffinity, 0).result() == pinning.engine_cores
            other.shutdown()
        finally:
            pool.shutdown()
            child.kill()
            child.wait()
    assert os.sched_getaffinity(0) == before


def test_core_pinning_refuses_an_unknown_placement():
    with pytest.raises(ValueError, match="placement 'gpu' must be one of"):
        CorePinning(True, placement="gpu")


def test_core_pinning_disabled_touches_nothing():
    before = os.sched_getaffinity(0)
    with CorePinning(False) as pinning:
        assert os.sched_getaffinity(0) == before
    assert pinning.describe() == {"trainer": None, "engine": None, "placement": None}


def test_cpu_meter_counts_own_and_other_cpu():
    with CpuMeter() as meter:
        end = time.process_time() + 0.3
        while time.process_time() < end:
            pass
    r = meter.result
    assert r["own_cpu_s"] >= 0.25 and r["wall_s"] >= 0.25 and r["trainer_cpu_s"] >= 0.25
    assert r["other_cpu_s"] >= 0.0 and 0.0 <= r["other_cpu_share"] <= 1.0


def test_time_to_target_and_summary():
    records = [{"time": 1.0, "eval/accuracy": 0.2}, {"time": 2.0}, {"time": 3.0, "eval/accuracy": 0.5}]
    assert _time_to(records, 0.45) == 3.0 and _time_to(records, 0.6) is None
    row = {
        "steps_per_s": 2.0,
        "samples_per_s": 300.0,
        "after": 0.5,
        "other_cpu_share": 0.1,
        "generate_s": 0.3,
        "train_s": 0.2,
        "step_wall_s": 0.15,
        "step_cpu_s": 0.1,
        "trainer_cpu_per_step_s": 0.12,
    }
    mean, ratio = summarize({"fully_async": [row, {**row, "samples_per_s": 500.0}], "sync": [row]})
    assert mean["fully_async"]["samples_per_s"] == 400.0 and ratio == pytest.approx(4 / 3)


def test_accuracy_gap_is_the_difference_of_binomial_means_with_its_standard_error():
    rows = {"fully_async": [{"after": 0.5, "eval_problems": 200}, {"after": 0.4, "eval_problems": 200}],
            "sync": [{"after": 0.47, "eval_problems": 200}]}
    gap = accuracy_gap(rows)
    # 0.45 over 400 answers against 0.47 over 200
    assert gap["difference"] == pytest.approx(-0.02)
    assert gap["standard_error"] == pytest.approx((0.45 * 0.55 / 400 + 0.47 * 0.53 / 200) ** 0.5)
    said = []
    _say_accuracy(said.append, gap)  # 2 points below with a standard error of 4.3: not told apart
    assert "-2.0 points" in said[0] and "not told apart" in said[0]
    _say_accuracy(said.append, {"difference": -0.1, "standard_error": 0.02})
    assert "more than twice the standard error" in said[1]
    _say_accuracy(said.append, {"difference": 0.0, "standard_error": 0.02})
    assert "at least the synchronous run's" in said[2]


def test_the_overlap_bound_comes_from_the_synchronous_phases():
    records = [{"timing/wait_s": 0.3, "timing/train_s": 0.15, "timing/sync_s": 0.05, "train_s": 0.14,
                "train_cpu_s": 0.1},
               {"timing/wait_s": 0.5, "timing/train_s": 0.25, "timing/sync_s": 0.05, "train_s": 0.24,
                "train_cpu_s": 0.2}]
    phases = phase_seconds(records)
    assert phases == {"generate_s": pytest.approx(0.4), "train_s": pytest.approx(0.25),
                      "step_wall_s": pytest.approx(0.19), "step_cpu_s": pytest.approx(0.15)}
    assert overlap_bound([phases]) == pytest.approx(0.65 / 0.4)
    assert overlap_bound([{"generate_s": 0.2, "train_s": 0.2}]) == pytest.approx(2.0)


def test_response_lengths_recorded_for_training_problems_only():
    task = CountUpTask(num_train=5, num_eval=3)
    lengths = record_response_lengths(task)
    train, held_out = task.train_problems()[0], task.eval_problems()[0]
    task.make_env(train).step("10,13,16")  # through the environment, as the generator scores
    task.reward(train, "1")
    assert task.make_env(held_out).step("10,13,16").done
    assert lengths == [9, 2]  # 8 characters + EOS, 1 + EOS; the held-out response left out
    p = make_problem("x", 7, 3, 30)
    assert task.reward(p, "10,13,16,19,22,25,28,31") == 1.0 and lengths[-1] == 24
    task.reward(p, "1," * 40)  # ran to the token limit: counted as the limit
    assert lengths[-1] == task.max_new_tokens


def test_a_run_the_time_cap_ended_is_reported_with_steps_only():
    said = []
    row = {"steps": 3, "time_capped": True}
    say_time_capped(said.append, "sync", 0, row, 5, 30.0)
    assert said == [
        "       sync round 0: stopped by the --seconds cap (30 s) after 3 of 5 steps (a slow or busy "
        "machine): raise --seconds for the whole budget"
    ]
    say_time_capped(said.append, "sync", 0, row, None, 30.0)  # --seconds is the budget: nothing to report
    say_time_capped(said.append, "sync", 0, {"steps": 5, "time_capped": False}, 5, 30.0)
    say_time_capped(said.append, "sync", 0, {"steps": 3, "time_capped": False}, 5, 30.0)  # the data ran out
    assert len(said) == 1


def test_step_budget_sets_the_training_steps_and_keeps_time_a_cap():
    cfg, job = bench_config(run_overrides("addition", 45.0, 10, [], steps=7))
    assert cfg.trainer.max_training_steps == 7 and job.max_train_seconds == 45.0
    cfg, job = bench_config(run_overrides("addition", 45.0, 10, []))
    assert cfg.trainer.max_training_steps is None and job.max_train_seconds == 45.0
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--steps", "0"])


def test_bench_rl_smoke_on_count_up(tmp_path):
    task = CountUpTask(num_train=1)
    model = build_base_model(
        tmp_path / "m",
        tokenizer=task.tokenizer,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=64,
    )
    out = tmp_path / "bench"
    assert (
        main(
            [
                "--model",
                str(model),
                "--steps",
                "2",
                "--seconds",
                "600",  # a cap only: the budget is the 2 steps, whatever the machine's load
                "--eval-interval",
                "1000",
                "--output-dir",
                str(out),
                "job.num_eval=8",
                "job.num_train=64",
                "job.tensorboard=false",
            ]
        )
        == 0
    )
    result = json.loads((out / "bench_rl.json").read_text())
    assert result["task"] == "count_up" and result["target"] == 0.45
    lengths = result["answer_length_tokens"]
    assert lengths["p50"] < lengths["p90"] <= lengths["p99"] <= lengths["max"] <= task.max_new_tokens
    for mode in ("fully_async", "sync"):
        (row,) = result["results"][mode]
        assert row["steps"] == 2 and not row["time_capped"]
        assert row["samples_per_s"] > 0 and "other_cpu_share" in row
        generated = row["response_length_tokens"]
        assert 1 <= generated["p50"] <= generated["max"] <= task.max_new_tokens
        pinned = len(os.sched_getaffinity(0)) >= 2
        assert (row["cores"]["engine"] is not None) == pinned
        assert row["cores"]["placement"] == ("training-thread" if pinned else None)
    assert result["throughput_ratio"] > 0
    pinned = len(os.sched_getaffinity(0)) >= 2
    # the bound's assumption, measured before each run
    assert len(result["core_independence"]) == 2
    assert all((value is not None) == pinned for value in result["core_independence"])
    (sync,) = result["results"]["sync"]
    assert sync["generate_s"] > 0 and sync["train_s"] > 0  # the phases of the bound, from this run
    # the train step's CPU time is its thread's, within its wall time and the trainer process's CPU
    assert 0 < sync["step_cpu_s"] <= sync["step_wall_s"] * 1.05
    assert sync["trainer_cpu_per_step_s"] >= sync["step_cpu_s"]
    assert 1.0 <= result["overlap_bound"] <= 2.0
    assert result["fraction_of_bound"] == pytest.approx(result["throughput_ratio"] / result["overlap_bound"])
    assert sync["eval_problems"] == 8  # job.num_eval: the accuracy gap's sample size
    assert result["accuracy_gap"]["standard_error"] > 0 or sync["after"] in (0.0, 1.0)
