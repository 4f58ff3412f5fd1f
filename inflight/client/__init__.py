"""Clients of inference engines: `InferenceClient` protocol, `LocalClient` (in process),
`RemoteClient` (HTTP, several servers, with a router) and `FanOutClient` (any clients as one)."""

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

__all__ = [
    "AuthenticationError",
    "ClientError",
    "FanOutClient",
    "FanOutError",
    "InconsistentServersError",
    "InferenceClient",
    "LocalClient",
    "RemoteClient",
    "RemoteEngineStateError",
    "RemoteError",
    "RemoteInvalidRequestError",
    "RemoteWeightUpdateError",
    "Router",
    "ServerError",
    "ServerUnavailableError",
    "update_weights",
]
