"""Weight sync: the one plan every backend follows (plan.py), chunking, the transports and the
factory that builds the configured one (factory.py)."""

from inflight.weight_sync.broadcast import BroadcastReceiver, BroadcastTransport
from inflight.weight_sync.chunking import TensorMeta, WeightChunk, iter_chunks
from inflight.weight_sync.factory import make_receiver, make_transport, transport_kind
from inflight.weight_sync.inprocess import InProcessTransport
from inflight.weight_sync.plan import KVFate, PauseMode, SyncPlan, plan_weight_sync
from inflight.weight_sync.receiver import ChannelReceiver, Receiver
from inflight.weight_sync.shm import ShmReceiver, ShmTransport
from inflight.weight_sync.transport import StagedUpdate, TransportError, WeightTransport

__all__ = [
    "BroadcastReceiver",
    "BroadcastTransport",
    "ChannelReceiver",
    "InProcessTransport",
    "KVFate",
    "PauseMode",
    "Receiver",
    "ShmReceiver",
    "ShmTransport",
    "StagedUpdate",
    "SyncPlan",
    "TensorMeta",
    "TransportError",
    "WeightChunk",
    "WeightTransport",
    "iter_chunks",
    "make_receiver",
    "make_transport",
    "plan_weight_sync",
    "transport_kind",
]
