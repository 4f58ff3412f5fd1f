"""The demo job's budgets are work, not wall time (issue 40: on a busy 2-vCPU machine its 90 s
warm-up ran 33 steps, and RL started from 0% accuracy): the supervised warm-up runs its
`job.warmup_steps` however slow the machine, RL its `trainer.max_training_steps`; their time caps
only end a run that would take longer, and the run says so. Real warm-ups of the tiny base model and
a real RL run; only the warm-up's clock is replaced (40 s a step)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

import inflight.tasks.base_model as base_model
from inflight.tasks import AdditionTask, build_base_model
from inflight.train.main import prepare_base_model, resolve_config, run_job

DEMO = Path(__file__).resolve().parents[2] / "examples" / "default.yaml"


class SlowClock:
    """`time` for the warm-up's module: each reading is `step_s` seconds after the last, and the
    warm-up reads it once a step (threads fixed: no timing probe), so every step takes `step_s`,
    whatever this machine does (the issue's busy machine took 2.7 s a step)."""

    def __init__(self, step_s: float) -> None:
        self.step_s, self.now = step_s, 0.0

    def perf_counter(self) -> float:
        self.now += self.step_s
        return self.now


def _warm_up_demo(tmp_path, monkeypatch, overrides: list[str]) -> tuple[dict, list[str]]:
    """The demo's own warm-up path (`prepare_base_model` with the demo config): a few small real
    steps of the tiny base model, each 40 s on the warm-up's clock."""
    from inflight.train.main import make_task

    cfg, job = resolve_config(str(DEMO), [f"job.output_dir={tmp_path}", "job.warmup_batch_size=8",
                                          "job.warmup_threads=1", "job.num_eval=20", *overrides])
    task = make_task(cfg, job)
    monkeypatch.setattr(base_model, "time", SlowClock(40.0))
    said: list[str] = []
    return prepare_base_model(cfg, job, task, said.append), said


def test_the_demo_warm_up_is_its_steps_not_its_time(tmp_path, monkeypatch):
    cfg, job = resolve_config(str(DEMO), [])
    assert job.warmup_steps == 300 and job.warmup_target_accuracy is None  # work, no early stop
    assert job.warmup_max_seconds >= 1000 and job.max_train_seconds >= 1000  # caps far above a quiet run
    assert cfg.trainer.max_training_steps == 2000
    warm, said = _warm_up_demo(tmp_path, monkeypatch, ["job.warmup_steps=4"])  # 160 s at 40 s a step
    assert warm["steps"] == 4 and warm["stopped_by"] == "steps"
    assert said[0].endswith("(supervised, 4 steps, capped at 1200 s)")
    assert not [line for line in said if "time cap" in line or "warmup_max_seconds" in line]


def test_a_warm_up_its_time_cap_ended_says_so(tmp_path, monkeypatch):
    warm, said = _warm_up_demo(tmp_path, monkeypatch, ["job.warmup_steps=6", "job.warmup_max_seconds=100"])
    assert warm["stopped_by"] == "time" and warm["steps"] == 3  # 120 s after its third step
    assert "warm-up stopped by its time cap (100 s) after step 3 of 6 (a slow or busy machine)" in "\n".join(
        said
    )
    assert said[-1].startswith("warm-up: 3 steps in ")
    assert "job.warmup_max_seconds ended it before its job.warmup_steps=6" in said[-1]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return build_base_model(tmp_path_factory.mktemp("base"), seed=0, hidden_size=32, num_hidden_layers=1,
                            intermediate_size=64)


def test_an_rl_run_its_time_cap_ended_says_so(tiny_model, tmp_path):
    cfg, job = resolve_config(
        str(DEMO),
        [
            f"trainer.policy.model.path={tiny_model}", "trainer.eval_interval=0",
            "trainer.train_batch_size=2", "trainer.policy_mini_batch_size=2",
            "generator.n_samples_per_prompt=2", "trainer.fully_async.num_parallel_generation_workers=2",
            "generator.inference_engine.weight_sync_backend=inprocess", f"job.output_dir={tmp_path}",
            "job.tensorboard=false", "job.progress=false", "job.plot=false", "job.max_train_seconds=1e-6",
        ],
    )  # over before the first step
    said: list[str] = []
    summary = asyncio.run(
        run_job(cfg, job, AdditionTask(max_digits=1, num_eval=4, num_train=40), said.append)
    )
    assert summary["time_capped"] and summary["steps"] < 20
    assert said[-1].startswith(
        f"RL stopped by its time cap, job.max_train_seconds=1e-06, after step "
        f"{summary['steps']} of 20: the result depends on this machine's speed and load"
    )
