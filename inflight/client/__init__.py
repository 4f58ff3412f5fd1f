"""Clients of inference engines: `InferenceClient` protocol, `LocalClient` (in process) and
`RemoteClient` (HTTP, several servers, with a router)."""

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
from inflight.client.local import LocalClient
from inflight.client.remote import RemoteClient
from inflight.client.router import Router

__all__ = [
    "AuthenticationError",
    "ClientError",
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
