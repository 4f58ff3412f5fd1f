"""Policy workers: one base (`PolicyWorker`, which executes every weight sync) and the backends."""

from inflight.train.workers.base import PolicyWorker, SyncReport, WeightSyncError
from inflight.train.workers.local import LocalPolicyWorker

__all__ = [
    "FSDPPolicyWorker", "LocalPolicyWorker", "MegatronPolicyWorker", "PolicyWorker", "SyncReport", "WeightSyncError",
]


def __getattr__(name: str):
    if name == "FSDPPolicyWorker":  # imported on use: FSDP pulls in much of torch.distributed
        from inflight.train.workers.fsdp import FSDPPolicyWorker

        return FSDPPolicyWorker
    if name == "MegatronPolicyWorker":  # imported on use: needs the optional megatron-core
        from inflight.train.workers.megatron import MegatronPolicyWorker

        return MegatronPolicyWorker
    raise AttributeError(name)
