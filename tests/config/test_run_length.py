"""A run's length is SkyRL 0.3.0's: `trainer.epochs` over the data, capped (never extended) by
`trainer.max_training_steps`; checked against SkyRL's own trainers' step count."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from oracle_import import import_oracle

from inflight.config import Config, load_config
from inflight.train.policy import run_training_steps


class _Rows(list):
    collate_fn = staticmethod(lambda batch: batch)


def skyrl_config():
    """SkyRL's default config (its trainers imported first: their import builds the pydantic models
    that the config holds, under the oracle importer's Python 3.11 shim)."""
    import_oracle("skyrl.train.trainer")
    import_oracle("skyrl.train.fully_async_trainer")
    return import_oracle("skyrl.train.config.config").SkyRLTrainConfig()


def skyrl_total_training_steps(fully_async: bool, prompts: int, **trainer: object) -> int:
    """`total_training_steps` as SkyRL's trainer (or its fully-async trainer) computes it for `prompts`
    rows, from SkyRL's default config with `trainer` set."""
    cfg = skyrl_config()
    cfg.data.dataloader.num_workers, cfg.data.dataloader.persistent_workers = 0, False
    for key, value in trainer.items():
        setattr(cfg.trainer, key, value)
    me = SimpleNamespace(
        cfg=cfg, train_dataset=_Rows(range(prompts)), mini_batch_size=cfg.trainer.policy_mini_batch_size
    )
    if fully_async:
        import_oracle("skyrl.train.fully_async_trainer").FullyAsyncRayPPOTrainer \
            ._build_train_dataloader_and_compute_training_steps(me)
    else:
        import_oracle("skyrl.train.trainer").RayPPOTrainer._build_train_dataloader_and_compute_training_steps(me)
    return me.total_training_steps


def test_the_default_is_skyrls():
    skyrl = skyrl_config()
    assert Config().trainer.max_training_steps == skyrl.trainer.max_training_steps
    assert Config().trainer.epochs == skyrl.trainer.epochs


@pytest.mark.parametrize("fully_async", [False, True])
@pytest.mark.parametrize("prompts, epochs, max_steps", [
    (2000, 1, 200),   # the GSM8K recipe: 125 steps in its one epoch, max_training_steps does not add any
    (2000, 3, 200),   # the cap ends the third epoch early
    (100, 2, None),
    (100, 1, 6),
    (40000, 1, 2000),  # the demo
])
def test_max_training_steps_caps_the_epochs_as_in_skyrl(fully_async, prompts, epochs, max_steps):
    """Issue 40: max_training_steps was documented as 'whatever the epochs', and taken as the run's
    step count (its learning-rate schedule and progress) even where the epochs end sooner."""
    batch = 16
    cfg = load_config(None, [f"trainer.train_batch_size={batch}", f"trainer.policy_mini_batch_size={batch}",
                             f"trainer.epochs={epochs}", f"trainer.max_training_steps={max_steps}",
                             f"trainer.fully_async.enabled={str(fully_async).lower()}",
                             f"trainer.fully_async.num_parallel_generation_workers={batch}",
                             "trainer.placement.colocate_all=false"])
    theirs = skyrl_total_training_steps(
        fully_async,
        prompts,
        train_batch_size=batch,
        policy_mini_batch_size=batch,
        epochs=epochs,
        max_training_steps=max_steps,
    )
    assert run_training_steps(cfg, prompts) == theirs
