"""An environment that fails outside its reward (built, reset, observation) costs that sample or its
group, never the run (issue 18 finding 3; SkyRL#1613's `skip_failed_rollouts`), on a real engine and
through both trainers: failed episodes keep their tokens with loss mask 0 and are counted, groups
none of whose episodes finished are dropped and recorded as `failed` (never trained, never lost), the
staleness accounting stays exact."""

from __future__ import annotations

import json
from collections.abc import Sequence

import pytest
from rl_support import SMALL_MODEL, play_train_problems, rl_config, run_training

from inflight.tasks import AdditionTask, build_base_model
from inflight.tasks.base import Environment, Problem, StepResult
from inflight.train.step import rollout_metrics


class BrokenEnv(Environment):
    """Fails by the problem's id: in reset, or when its observation is turned into tokens."""

    max_turns = 2

    def __init__(self, problem: Problem) -> None:
        self.problem = problem

    resets: dict[str, int] = {}

    def reset(self):
        count = self.resets[self.problem.id] = self.resets.get(self.problem.id, 0) + 1
        if self.problem.id.startswith("reset") or (self.problem.id.startswith("flaky") and count == 1):
            raise ConnectionError("sandbox unreachable")
        return self.problem.prompt

    def step(self, response: str) -> StepResult:
        if self.problem.id.startswith("observe"):
            return StepResult(observation=object(), reward=0.0, done=False)  # not text, not messages
        return StepResult(observation=None, reward=float(ord(response[:1] or "a") % 2), done=True)


class BrokenTask(AdditionTask):
    def __init__(self, ids: Sequence[str], **kwargs) -> None:
        super().__init__(max_digits=1, **kwargs)
        self.ids = list(ids)

    def train_problems(self) -> Sequence[Problem]:
        return [Problem(pid, "1+2=", "3") for pid in self.ids]

    def make_env(self, problem: Problem) -> Environment:
        return BrokenEnv(problem)

    @property
    def stop_token_ids(self) -> list[int]:
        """Every token ends a turn: each turn is one token and ends by a stop, so multi-turn
        episodes reach their observation whatever the untrained model samples."""
        return list(range(len(self.tokenizer)))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_base_model(tmp_path_factory.mktemp("cold-addition"), seed=0, **SMALL_MODEL)


def _play(model_dir, task, skip: bool):
    return play_train_problems(model_dir, task, skip_failed_rollouts=skip)


def test_failed_episodes_score_zero_and_say_why(model_dir):
    groups = {g.prompt_id: g for g in _play(model_dir, BrokenTask(["reset-1", "observe-1", "ok-1"]), True)}
    reset, observe, ok = groups["reset-1"], groups["observe-1"], groups["ok-1"]
    assert not reset.usable and all(t.rollout_failed and t.prompt_ids == [] for t in reset.trajectories)
    assert (
        "setting up the environment: ConnectionError: sandbox unreachable"
        in reset.trajectories[0].info["rollout_error"]
    )
    assert all(t.rollout_failed and t.reward == 0.0 and t.response_ids for t in observe.trajectories)
    assert all(t.num_sampled > 0 and not any(t.loss_mask) for t in observe.trajectories)  # kept, masked
    assert not observe.usable  # none of its episodes finished: nothing to learn from
    assert "turning the observation into tokens" in observe.trajectories[0].info["rollout_error"]
    assert ok.usable and not any(t.rollout_failed for t in ok.trajectories)
    metrics = rollout_metrics([observe, ok], 0)
    assert metrics["rollout/failed"] == 2.0
    assert metrics["rollout/failed_tokens_masked"] == sum(t.num_sampled for t in observe.trajectories)


def test_an_episode_that_could_not_start_costs_itself_not_its_group(model_dir):
    BrokenEnv.resets.clear()
    [flaky] = _play(model_dir, BrokenTask(["flaky-1"]), True)
    failed = [t for t in flaky.trajectories if t.rollout_failed]
    finished = [t for t in flaky.trajectories if not t.rollout_failed]
    assert len(failed) == 1 and finished and flaky.usable  # the group is trained on
    assert failed[0].prompt_ids == finished[0].prompt_ids and failed[0].response_ids == []  # a row, empty
    assert flaky.spread == max(t.reward for t in finished) - min(t.reward for t in finished)


def test_skip_failed_rollouts_false_ends_the_run_naming_the_problem(model_dir):
    with pytest.raises(RuntimeError, match=r"problem 'reset-1': the environment failed setting up"):
        _play(model_dir, BrokenTask(["reset-1"]), False)


@pytest.mark.parametrize("fully_async", [True, False])
def test_training_drops_groups_that_could_not_start_and_trains_the_rest(model_dir, tmp_path, fully_async):
    ids = [f"{'reset' if i % 3 == 0 else 'ok'}-{i}" for i in range(24)]
    cfg, job = rl_config(model_dir, tmp_path, ["job.max_steps=2", "trainer.eval_interval=0",
                                               f"trainer.fully_async.enabled={str(fully_async).lower()}"])
    task = BrokenTask(ids, num_eval=4, num_train=len(ids))

    history = run_training(cfg, job, task)
    assert len(history) == 2 and sum(r["optimizer_steps"] for r in history) > 0
    consumed = [json.loads(line) for line in (tmp_path / "consumed.jsonl").read_text().splitlines()]
    failed = [p for row in consumed for p in row.get("failed", [])]
    trained = [p for row in consumed for p in row.get("trained", [])]
    assert failed and all(p.startswith("reset") for p in failed)
    assert trained and not any(p.startswith("reset") for p in trained)
    assert not set(failed) & set(trained)
    assert history[-1]["rollout/failed_groups"] == len(failed)
