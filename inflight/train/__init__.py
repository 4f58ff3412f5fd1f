"""Training: batches, losses, policy workers (one base, several backends) and the local policy."""

from inflight.train.algorithms import rl_loss
from inflight.train.batch import TrainBatch
from inflight.train.losses import cross_entropy_loss, token_logprobs
from inflight.train.policy import LocalPolicy
from inflight.train.workers import LocalPolicyWorker, PolicyWorker, SyncReport, WeightSyncError

__all__ = [
    "LocalPolicy", "LocalPolicyWorker", "PolicyWorker", "SyncReport", "TrainBatch", "WeightSyncError",
    "cross_entropy_loss", "rl_loss", "token_logprobs"
]
