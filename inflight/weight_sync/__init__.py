"""Weight sync: the one plan every backend follows (plan.py), chunking, the transport kinds
(kinds.py: one `TransportSpec` each), the transports and the factory that builds the configured
one (factory.py).

The names below are imported on first use (PEP 562), so that the config layer can read the
transport kinds (`inflight.weight_sync.kinds`, a leaf) without importing torch or the transports."""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "BroadcastReceiver": "inflight.weight_sync.broadcast",
    "BroadcastTransport": "inflight.weight_sync.broadcast",
    "TensorMeta": "inflight.weight_sync.chunking",
    "WeightChunk": "inflight.weight_sync.chunking",
    "iter_chunks": "inflight.weight_sync.chunking",
    "configured_transport": "inflight.weight_sync.factory",
    "make_transport": "inflight.weight_sync.factory",
    "InProcessTransport": "inflight.weight_sync.inprocess",
    "SenderSite": "inflight.weight_sync.kinds",
    "TransportSpec": "inflight.weight_sync.kinds",
    "register_transport": "inflight.weight_sync.kinds",
    "transport_names": "inflight.weight_sync.kinds",
    "transport_spec": "inflight.weight_sync.kinds",
    "KVFate": "inflight.weight_sync.plan",
    "PauseMode": "inflight.weight_sync.plan",
    "SyncPlan": "inflight.weight_sync.plan",
    "plan_weight_sync": "inflight.weight_sync.plan",
    "ChannelReceiver": "inflight.weight_sync.receiver",
    "Receiver": "inflight.weight_sync.receiver",
    "ShmReceiver": "inflight.weight_sync.shm",
    "ShmTransport": "inflight.weight_sync.shm",
    "StagedUpdate": "inflight.weight_sync.transport",
    "TransportError": "inflight.weight_sync.transport",
    "WeightTransport": "inflight.weight_sync.transport",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
