"""A fully-async run with a non-default estimator and loss (maxrl, cispo) learns on the built-in task:
issue 29's "done when"."""

from __future__ import annotations

import pytest
from rl_support import rl_config, warm_model_dir
from test_trainer_algorithms import SIZES, _run

from inflight.tasks import AdditionTask


class TrainedAndHeldOut(AdditionTask):
    """One-digit addition evaluated on its 80 training pairs and its 20 held-out ones."""

    def eval_sets(self) -> dict[str, list]:
        trained = {p.prompt: p for p in self.train_problems()}
        return {"trained": list(trained.values()), "held_out": list(self.eval_problems())}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return warm_model_dir(tmp_path_factory)


def test_a_fully_async_run_with_maxrl_and_cispo_learns(model_dir, tmp_path):
    """150 steps of 16 prompts x 8: the greedy accuracy on the problems it trains on rises well above
    where the warmed-up model starts (the held-out pairs are reported, not required: a 2-layer,
    64-wide model generalises little in 150 steps)."""
    cfg, job = rl_config(model_dir, tmp_path, [
        *SIZES, "trainer.train_batch_size=16", "trainer.policy_mini_batch_size=16",
        "generator.n_samples_per_prompt=8", "trainer.fully_async.num_parallel_generation_workers=32",
        "trainer.epochs=30", "job.max_steps=150", "trainer.algorithm.advantage_estimator=maxrl",
        "trainer.algorithm.policy_loss_type=cispo"])  # fmt: skip
    task = TrainedAndHeldOut(max_digits=1, num_eval=20, num_train=400)
    trainer, history, before, after = _run(cfg, job, task, evaluate=True)
    assert trainer.mode == "fully_async" and len(history) == 150
    assert max(r["staleness_max"] for r in history) >= 1  # generation ran ahead of training
    trained = "eval/trained/pass@1"
    assert after["metrics"][trained] >= before["metrics"][trained] + 0.1, (
        before["metrics"], after["metrics"])
    assert after["accuracy"] > before["accuracy"]
