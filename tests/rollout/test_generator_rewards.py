"""Reward failures never end a run: a reward that raises, returns no finite number or takes longer
than `environment.reward_timeout_s` (sync or async) scores its sample 0 and is counted
(`reward/failures`), on a real engine and through a whole training run."""

from __future__ import annotations

import asyncio
import json
import math
import threading
import time
from collections.abc import Sequence

import pytest
from rl_support import SMALL_MODEL, play_train_problems, rl_config, run_training, small_task

from inflight.tasks import AdditionTask, build_base_model
from inflight.tasks.base import Problem, bounded, is_bounded
from inflight.train.step import rollout_metrics


async def _slow(seconds: float) -> float:
    await asyncio.sleep(seconds)
    return 1.0


async def _fine() -> float:
    return 1.0


class MisbehavingTask(AdditionTask):
    """Addition whose reward misbehaves by prompt: raises, NaN, hangs (sync or async), or is fine."""

    KINDS = ("raise", "nan", "sync_hang", "async_hang", "async_ok", "ok")

    def train_problems(self) -> Sequence[Problem]:
        return [Problem(kind, "1+2=", "3") for kind in self.KINDS]

    def reward(self, problem: Problem, response: str):
        kind = problem.id
        if kind == "raise":
            raise KeyError("the grader broke")
        if kind == "nan":
            return math.nan
        if kind == "sync_hang":
            time.sleep(30)  # abandoned in its daemon thread
        if kind == "async_hang":
            return _slow(30)
        return _fine() if kind == "async_ok" else 1.0


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_base_model(tmp_path_factory.mktemp("cold-addition"), seed=0, **SMALL_MODEL)


def play(model_dir, task, timeout):
    return play_train_problems(model_dir, task, reward_timeout_s=timeout)


def test_failing_rewards_score_zero_and_are_counted(model_dir):
    task = MisbehavingTask(max_digits=1, num_eval=5, num_train=10)
    started = time.perf_counter()
    groups = play(model_dir, task, timeout=0.5)
    assert time.perf_counter() - started < 10  # nobody waited for the hung rewards
    by_kind = {g.prompt_id: g.trajectories for g in groups}
    for kind in ("raise", "nan", "sync_hang", "async_hang"):
        for t in by_kind[kind]:
            assert t.reward == 0.0 and t.reward_failed, kind
    assert all("reward_timeout_s=0.5" in t.info["reward_error"] for k in ("sync_hang", "async_hang")
               for t in by_kind[k])
    assert by_kind["raise"][0].info["reward_error"] == "KeyError: 'the grader broke'"
    assert "not a finite number" in by_kind["nan"][0].info["reward_error"]
    for kind in ("async_ok", "ok"):
        assert all(t.reward == 1.0 and not t.reward_failed for t in by_kind[kind])
    assert rollout_metrics(groups, 0)["reward/failures"] == 8.0


def test_without_a_timeout_a_raising_reward_is_still_caught(model_dir):
    task = MisbehavingTask(max_digits=1, num_eval=5, num_train=10)
    task.KINDS = ("raise", "async_ok")
    groups = play(model_dir, task, timeout=None)
    assert [t.reward_failed for g in groups for t in g.trajectories] == [True, True, False, False]


class ThreadRecordingTask(AdditionTask):
    """Addition whose reward notes the thread it runs on; `marked` keeps the `@bounded` mark."""

    def __init__(self, *args, marked: bool, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.threads: list[threading.Thread] = []
        score = super().reward

        def reward(problem: Problem, response: str) -> float:
            self.threads.append(threading.current_thread())
            return score(problem, response)

        self.reward = bounded(reward) if marked else reward


@pytest.mark.parametrize("marked", [True, False])
def test_a_bounded_reward_runs_on_the_loop_and_any_other_in_a_thread(model_dir, marked):
    task = ThreadRecordingTask(max_digits=1, num_eval=5, num_train=3, marked=marked)
    groups = play(model_dir, task, timeout=5.0)
    assert len(task.threads) == 6 and all(not t.reward_failed for g in groups for t in g.trajectories)
    on_loop = [t is threading.main_thread() for t in task.threads]  # asyncio.run's loop: this thread
    assert on_loop == [marked] * 6
    assert is_bounded(AdditionTask.reward) and not is_bounded(MisbehavingTask.reward)  # an override drops it


class FlakyTask(AdditionTask):
    """A reward that raises for every response of odd length and gives 1 to the others (so groups
    mix failures, scored 0, with successes, and the trainer has something to learn)."""

    def reward(self, problem: Problem, response: str) -> float:
        if len(response) % 2:
            raise RuntimeError("odd")
        return 1.0


def test_training_goes_on_through_reward_failures_and_logs_them(model_dir, tmp_path):
    cfg, job = rl_config(model_dir, tmp_path, ["job.max_steps=2", "trainer.eval_interval=0",
                                               "environment.reward_timeout_s=5"])
    base = small_task()
    task = FlakyTask(max_digits=1, num_eval=base.num_eval, num_train=40)

    history = run_training(cfg, job, task)
    assert len(history) == 2
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    assert all("reward/failures" in r for r in records) and sum(r["reward/failures"] for r in records) > 0
    assert sum(r["optimizer_steps"] for r in records) > 0  # and it trained on the groups
