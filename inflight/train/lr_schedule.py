"""The learning-rate schedule of a policy's optimizer (`trainer.policy.optimizer_config.scheduler`).

transformers' `get_scheduler` builds it; this module only decides the step count it decays over
and refuses a decaying schedule without one.
"""

from __future__ import annotations

import torch
from torch.optim.lr_scheduler import LRScheduler

SCHEDULERS = ("constant", "constant_with_warmup", "linear", "cosine")
DECAYING = ("linear", "cosine")


def make_lr_scheduler(optimizer: torch.optim.Optimizer, name: str, num_warmup_steps: int,
                      num_training_steps: int | None) -> LRScheduler:
    """The schedule `name` over `num_training_steps` optimizer steps, after `num_warmup_steps`
    of linear warm-up. `constant` ignores the warm-up (as transformers does)."""
    from transformers import get_scheduler

    if name not in SCHEDULERS:
        raise ValueError(f"trainer.policy.optimizer_config.scheduler={name!r}: use one of {list(SCHEDULERS)}")
    if name in DECAYING and not num_training_steps:
        raise ValueError(
            f"trainer.policy.optimizer_config.scheduler={name!r} decays over the run's optimizer "
            "steps, which are unknown here: set trainer.max_training_steps"
        )
    return get_scheduler(
        name, optimizer, num_warmup_steps=num_warmup_steps, num_training_steps=num_training_steps
    )
