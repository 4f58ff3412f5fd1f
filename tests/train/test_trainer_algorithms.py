"""SkyRL's algorithms through the trainers, with a real engine: the KL in the reward with the adaptive
controller in both trainers (SkyRL's fully-async trainer never builds the controller), and dynamic
sampling (filter, replace) in the synchronous trainer. (test_learning.py: a run that learns.)"""

from __future__ import annotations

import asyncio
import json

import pytest
from rl_support import rl_config, warm_model_dir

from inflight.tasks import AdditionTask
from inflight.train.trainer import make_trainer

SIZES = (
    "trainer.train_batch_size=4", "trainer.policy_mini_batch_size=4", "generator.n_samples_per_prompt=4",
    "trainer.fully_async.num_parallel_generation_workers=8", "trainer.eval_interval=0",
    "generator.eval_sampling_params.temperature=0", "generator.eval_sampling_params.max_generate_length=8",
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return warm_model_dir(tmp_path_factory)


def _run(cfg, job, task, evaluate: bool = False):
    async def main():
        trainer = make_trainer(cfg, job, task)
        try:
            await trainer.setup()
            before = await trainer.evaluate() if evaluate else None
            history = await trainer.train()
            after = await trainer.evaluate() if evaluate else None
            return trainer, history, before, after
        finally:
            await trainer.close()

    return asyncio.run(main())


@pytest.mark.parametrize("mode", ["sync", "fully_async"])
def test_kl_in_the_reward_with_the_adaptive_controller(model_dir, tmp_path, mode):
    """Every step's coefficient is the last one moved by Ziegler et al.'s law: value *= 1 + clip(avg_kl
    / kl_target - 1, -0.2, 0.2) * rows / horizon."""
    cfg, job = rl_config(model_dir, tmp_path, [
        *SIZES, f"trainer.fully_async.enabled={mode == 'fully_async'}", "job.max_steps=3",
        "trainer.algorithm.use_kl_loss=false", "trainer.algorithm.use_kl_in_reward=true",
        "trainer.algorithm.kl_loss_coef=0.1", "trainer.algorithm.kl_ctrl.type=adaptive",
        "trainer.algorithm.kl_ctrl.kl_target=0.001", "trainer.algorithm.kl_ctrl.horizon=40",
        "trainer.algorithm.zero_variance_filter=false",
        "trainer.policy.optimizer_config.lr=1e-3"])  # fmt: skip
    trainer, history, _, _ = _run(cfg, job, AdditionTask(max_digits=1, num_eval=20, num_train=400))
    assert trainer.mode == mode and len(history) == 3 and trainer.policy.reference is not None
    coefs = [r["kl_loss_coef"] for r in history]
    assert coefs[0] == pytest.approx(0.1)
    for prev, coef in zip(history, coefs[1:], strict=False):
        error = min(max(prev["avg_kl"] / 0.001 - 1, -0.2), 0.2)
        assert coef == pytest.approx(prev["kl_loss_coef"] * (1 + error * prev["samples"] / 40), rel=1e-6)
    assert coefs[1] != coefs[0] and history[-1]["avg_kl"] > 0


def _consumed(tmp_path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "consumed.jsonl").read_text().splitlines()]


def test_dynamic_sampling_filter_fills_every_batch_with_signal(model_dir, tmp_path):
    task = AdditionTask(max_digits=1, num_eval=20, num_train=400)
    cfg, job = rl_config(model_dir, tmp_path, [*SIZES, "trainer.fully_async.enabled=false", "job.max_steps=3",
                                               "trainer.algorithm.dynamic_sampling.type=filter",
                                               "trainer.algorithm.dynamic_sampling.max_sample_batches=-1"])
    _, history, _, _ = _run(cfg, job, task)
    assert [r["groups"] for r in history] == [4, 4, 4] and all(r["groups_dropped"] == 0 for r in history)
    records = _consumed(tmp_path)
    trained = [i for r in records for i in r.get("trained", [])]
    rejected = [i for r in records for i in r.get("rejected", [])]
    # the warmed-up model gets some prompts right (or wrong) every time
    assert len(trained) == 12 and rejected
    assert not set(trained) & set(rejected)


def test_dynamic_sampling_replace_copies_informative_groups(model_dir, tmp_path):
    task = AdditionTask(max_digits=1, num_eval=20, num_train=400)
    cfg, job = rl_config(model_dir, tmp_path, [*SIZES, "trainer.fully_async.enabled=false", "job.max_steps=3",
                                               "trainer.algorithm.dynamic_sampling.type=replace",
                                               "trainer.algorithm.dynamic_sampling.min_replace_ratio=0.0"])
    _, history, _, _ = _run(cfg, job, task)
    assert [r["groups"] for r in history] == [4, 4, 4]
    records = _consumed(tmp_path)
    trained = [i for r in records for i in r.get("trained", [])]
    rejected = [i for r in records for i in r.get("rejected", [])]
    assert len(trained) + len(rejected) == 12 and rejected  # each rejected prompt's place went to a copy
    assert sum(r["groups_trained"] for r in history) == 12  # copies of informative groups: all have signal
