"""Weight sync: the one plan every backend follows (plan.py); transports and orchestration."""

from inflight.weight_sync.plan import KVFate, PauseMode, ResetOwner, SyncPlan, plan_weight_sync

__all__ = ["KVFate", "PauseMode", "ResetOwner", "SyncPlan", "plan_weight_sync"]
