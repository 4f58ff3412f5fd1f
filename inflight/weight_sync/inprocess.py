"""In-process transport: the tensors go straight to the client's `load_weights`.

For a `LocalClient` (engine in the trainer's process) nothing is copied on the way: the engine
copies each tensor into its parameters. For a `RemoteClient` this is "weights over the control
API" (the client serialises them), which is the slow path and fine for small models.
"""

from __future__ import annotations

from inflight.weight_sync.chunking import WeightChunk
from inflight.weight_sync.kinds import SenderSite
from inflight.weight_sync.transport import UpdateClient, WeightTransport


class InProcessTransport(WeightTransport):
    """Hands each chunk to `client.load_weights`; lifecycle calls go to the client too."""

    name = "inprocess"

    async def send_chunk(self, client: UpdateClient, chunk: WeightChunk) -> None:
        await client.load_weights(chunk.named_tensors())


def build_sender(site: SenderSite) -> InProcessTransport:
    """The `inprocess` kind's sender (`TransportSpec.sender`): only the chunk size applies."""
    return InProcessTransport(max_chunk_bytes=site.max_chunk_bytes)
