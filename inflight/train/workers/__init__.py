"""Policy workers: one base (`PolicyWorker`, which executes every weight sync) and the backends
(`workers.fsdp`, and `inflight.megatron` above this package: imported on use, through
`inflight.train.strategies`)."""

from inflight.train.workers.base import PolicyWorker, SyncReport, WeightSyncError
from inflight.train.workers.local import LocalPolicyWorker

__all__ = ["LocalPolicyWorker", "PolicyWorker", "SyncReport", "WeightSyncError"]
