"""Clients of inference engines: the `InferenceClient` protocol written once as operations
(`base.py`), and how an operation travels: `LocalClient` (in process), `ProcessClient` /
`RayEngineClient` (another process, `process.py`), `RemoteClient` (HTTP, several servers) and
`FanOutClient` (any clients as one). `update_all_or_nothing` is THE weight update."""

from inflight.client.base import InferenceClient, update_weights
from inflight.client.errors import (
    AuthenticationError,
    ClientError,
    FanOutError,
    InconsistentServersError,
    RemoteEngineStateError,
    RemoteError,
    RemoteInvalidRequestError,
    RemoteWeightUpdateError,
    ServerError,
    ServerUnavailableError,
)
from inflight.client.fanout import FanOutClient
from inflight.client.local import LocalClient
from inflight.client.remote import RemoteClient
from inflight.client.router import Router
from inflight.client.update import UpdateProgress, update_all_or_nothing

__all__ = [
    "AuthenticationError", "ClientError", "FanOutClient", "FanOutError", "InconsistentServersError",
    "InferenceClient", "LocalClient", "RemoteClient", "RemoteEngineStateError", "RemoteError",
    "RemoteInvalidRequestError", "RemoteWeightUpdateError", "Router", "ServerError",
    "ServerUnavailableError", "UpdateProgress", "update_all_or_nothing", "update_weights"
]
