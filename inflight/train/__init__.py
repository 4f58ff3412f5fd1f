"""Training: batches, losses, policy workers (one base, several backends) and the local policy.

The names below are imported on first use (PEP 562), so that importing a light module of this
package (`inflight.train.main`) does not import torch: `inflight train
--print-config` validates a config without it."""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "rl_loss": "inflight.train.objective",
    "TrainBatch": "inflight.train.batch",
    "token_mean_nll_loss": "inflight.train.losses",
    "token_logprobs": "inflight.train.losses",
    "LocalPolicy": "inflight.train.policy",
    "LocalPolicyWorker": "inflight.train.workers",
    "PolicyWorker": "inflight.train.workers",
    "SyncReport": "inflight.train.workers",
    "WeightSyncError": "inflight.train.workers",
}

__all__ = [
    "LocalPolicy", "LocalPolicyWorker", "PolicyWorker", "SyncReport", "TrainBatch", "WeightSyncError",
    "token_mean_nll_loss", "rl_loss", "token_logprobs"
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
