"""The weight-transport kinds: one `TransportSpec` per `generator.inference_engine.weight_sync_backend`
value, registered here, looked up with `transport_spec(name)`.

The rest of the tree asks a spec what it needs to know (are the engines in the trainer's process,
must they be on its host, does the sender form a group with them, ...) instead of comparing names;
the engine process receives the spec itself (`client.process.ReceiverSpec`).

This module is a leaf below the config layer (the standard library and `inflight.import_path`
only; its own rank in tests/test_layers.py): config validation reads the facts, and the config
layer does not import the transports. So a spec names its two builders as `package.module:name`,
imported when a run builds a sender or a receiver.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from inflight.import_path import import_object


@dataclass(frozen=True)
class SenderSite:
    """What a sender builder takes: where it listens (`port` 0: a free one), how many engine ranks
    connect, a chunk's size, the device of a broadcast buffer (a str or torch.device), how long it
    waits for receivers, and whether `shm` packs an update before the pause (`weight_sync_staged`)."""

    host: str
    port: int
    num_receivers: int
    max_chunk_bytes: int
    device: Any = "cpu"
    timeout: float = 600.0
    staged: bool = True


@dataclass(frozen=True)
class TransportSpec:
    """One weight transport kind: how its two ends are built, and the facts callers ask."""

    name: str
    sender: str
    """`package.module:name` of `(SenderSite) -> WeightTransport`: policy rank 0's side."""
    receiver: str | None
    """`package.module:name` of `(host, port, *, rank, num_receivers, device, timeout) ->
    ChannelReceiver`: an engine's side; None: no receiver, the engines live in the trainer's process."""
    aliases: tuple[str, ...] = ()
    """SkyRL's `weight_sync_backend` values read as this kind."""
    same_node: bool = False
    """The receivers must be on the sender's host (shared memory): Ray packs the run onto one node,
    and servers started elsewhere on other hosts are refused."""
    chunk_files: bool = False
    """Into HTTP servers the client hands each chunk as a file in /dev/shm (else in the request body)."""
    forms_group: bool = False
    """The receivers join a torch.distributed group the sender hosts at weight_sync_host:port,
    formed (`connect()`) once they are started; into HTTP servers the servers join it, so they
    must reach that address."""

    @property
    def in_trainer_process(self) -> bool:
        """The engines run in the trainer's process (no receiver; no engine process to restart)."""
        return self.receiver is None

    def build_sender(self, site: SenderSite) -> Any:
        """This kind's sending side at `site` (a `WeightTransport`)."""
        return import_object(self.sender, f"the {self.name} transport's sender", TypeError)(site)

    def build_receiver(self, host: str, port: int, *, rank: int = 1, num_receivers: int = 1,
                       device: Any = "cpu", timeout: float = 600.0) -> Any:
        """An engine's receiver (a `ChannelReceiver`) for this kind's sender at host:port, receiver
        `rank` of `num_receivers`. Blocks until it reaches the sender (a group: until it forms), so
        build it in the thread that will `serve` the engine."""
        if self.receiver is None:
            raise ValueError(f"the {self.name} transport has no receiver: its engines live in the trainer's "
                             "process (check `in_trainer_process` before building one)")
        build = import_object(self.receiver, f"the {self.name} transport's receiver", TypeError)
        return build(host, port, rank=rank, num_receivers=num_receivers, device=device, timeout=timeout)


_REGISTRY: dict[str, TransportSpec] = {}


def register_transport(spec: TransportSpec) -> TransportSpec:
    """Add `spec` to the kinds `transport_spec` finds (its name and aliases must be new); returns it."""
    taken = [n for n in (spec.name, *spec.aliases) if n in _REGISTRY or n in transport_aliases()]
    if taken:
        raise ValueError(f"weight transport {spec.name!r}: {taken} already name a registered transport")
    _REGISTRY[spec.name] = spec
    return spec


def transport_names() -> tuple[str, ...]:
    """The registered kinds' names, in registration order."""
    return tuple(_REGISTRY)


def transport_aliases() -> dict[str, str]:
    """{alias: name} of every registered kind's aliases (SkyRL's names)."""
    return {alias: spec.name for spec in _REGISTRY.values() for alias in spec.aliases}


def transport_spec(name: str) -> TransportSpec:
    """The registered kind called `name` (or one of its aliases); a ValueError lists the known ones."""
    spec = _REGISTRY.get(transport_aliases().get(name, name))
    if spec is None:
        known = ", ".join(
            f"{n} (or {', '.join(s.aliases)})" if s.aliases else n for n, s in _REGISTRY.items()
        )
        raise ValueError(f"weight transport {name!r} is not registered; known: {known}")
    return spec


_WS = "inflight.weight_sync."
INPROCESS = register_transport(
    TransportSpec("inprocess", sender=_WS + "inprocess:build_sender", receiver=None)
)
SHM = register_transport(TransportSpec(
    "shm", sender=_WS + "shm:build_sender", receiver=_WS + "shm:build_receiver", aliases=("cuda_ipc",),
    same_node=True, chunk_files=True,
))
BROADCAST = register_transport(TransportSpec(
    "broadcast", sender=_WS + "broadcast:build_sender", receiver=_WS + "broadcast:build_receiver",
    aliases=("nccl", "gloo"), forms_group=True,
))
