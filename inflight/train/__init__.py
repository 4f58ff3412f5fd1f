"""Training: batches, losses, policy workers (one base, several backends) and the dispatch."""

from inflight.train.algorithms import rl_loss
from inflight.train.batch import TrainBatch
from inflight.train.dispatch import WorkerDispatch
from inflight.train.losses import cross_entropy_loss, token_logprobs
from inflight.train.workers import LocalPolicyWorker, PolicyWorker, SyncReport, WeightSyncError

__all__ = [
    "LocalPolicyWorker",
    "PolicyWorker",
    "SyncReport",
    "TrainBatch",
    "WeightSyncError",
    "WorkerDispatch",
    "cross_entropy_loss",
    "rl_loss",
    "token_logprobs",
]
