"""Learning-rate schedules (`trainer.policy.optimizer_config.scheduler`, `num_warmup_steps`): the
rate each optimizer step used, reported as `lr`, follows the schedule's formula, and a checkpoint
resumes it where it stopped."""

from __future__ import annotations

import math

import pytest
import torch

from inflight.config import ConfigError, load_config
from inflight.testing import LOCAL_CPU
from inflight.train import LocalPolicyWorker, TrainBatch
from inflight.train.checkpoint import load_latest, load_optimizer, save_checkpoint

LR = 1e-3


def _batch() -> TrainBatch:
    ids = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[:, 0] = 0
    return TrainBatch(input_ids=ids, loss_mask=mask)


def _worker(model_dir, scheduler: str, warmup: int, total: int | None) -> LocalPolicyWorker:
    cfg = load_config(None, [*LOCAL_CPU, f"trainer.policy.optimizer_config.lr={LR}",
                             f"trainer.policy.optimizer_config.scheduler={scheduler}",
                             f"trainer.policy.optimizer_config.num_warmup_steps={warmup}"])
    worker = LocalPolicyWorker(cfg, model_path=str(model_dir))
    worker.num_training_steps = total
    return worker.setup()


def _expected(scheduler: str, step: int, warmup: int, total: int) -> float:
    if scheduler != "constant" and step < warmup:
        return LR * step / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return {
        "constant": LR,
        "constant_with_warmup": LR,
        "linear": LR * max(0.0, 1 - progress),
        "cosine": LR * 0.5 * (1 + math.cos(math.pi * progress)),
    }[scheduler]


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory):
    return tiny_model_factory("qwen2", seed=5)


@pytest.mark.parametrize("scheduler", ["constant", "constant_with_warmup", "linear", "cosine"])
def test_each_step_reports_the_rate_the_schedule_gives(model_dir, scheduler):
    worker = _worker(model_dir, scheduler, warmup=2, total=6)
    rates = [worker.train_step(_batch())["lr"] for _ in range(6)]
    assert rates == pytest.approx([_expected(scheduler, s, 2, 6) for s in range(6)], abs=1e-12)


def test_a_checkpoint_resumes_the_schedule(model_dir, tmp_path):
    worker = _worker(model_dir, "cosine", warmup=1, total=8)
    for _ in range(3):
        worker.train_step(_batch())
    save_checkpoint(tmp_path, 3, worker, model_dir, weight_version=3, data={})
    resumed = _worker(model_dir, "cosine", warmup=1, total=8)
    load_optimizer(resumed, load_latest(tmp_path))
    assert resumed.train_step(_batch())["lr"] == pytest.approx(_expected("cosine", 3, 1, 8), abs=1e-12)


def test_a_decaying_schedule_needs_the_run_length(model_dir):
    with pytest.raises(ValueError, match=r"scheduler='cosine' decays over the run's optimizer steps"):
        _worker(model_dir, "cosine", warmup=0, total=None)


def test_bad_schedule_keys_are_listed():
    with pytest.raises(ConfigError) as err:
        load_config(None, [*LOCAL_CPU, "trainer.policy.optimizer_config.scheduler=cosin",
                           "trainer.policy.optimizer_config.num_warmup_steps=-1"])
    assert sorted(err.value.keys) == ["trainer.policy.optimizer_config.num_warmup_steps",
                                      "trainer.policy.optimizer_config.scheduler"]
