"""THE all-or-nothing weight update: begin → one send per chunk → finish, aborted on any failure.

Every weight update goes through `update_all_or_nothing`: the sync executor's (with the configured
`WeightTransport`) and the clients' `update_weights_broadcast` (with the group they host).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from torch import Tensor

from inflight.client.base import InferenceClient
from inflight.weight_sync.transport import StagedUpdate, WeightTransport


class Progress(Protocol):
    """Where an update books what it did (the executor's SyncReport is one)."""

    chunks: int
    bytes: int
    restored: bool | None


@dataclass
class UpdateProgress:
    """What an update did: chunks and payload bytes sent; on failure whether the old weights came
    back (`restored`)."""

    chunks: int = 0
    bytes: int = 0
    restored: bool | None = None


async def update_all_or_nothing(
    client: InferenceClient,
    sender: WeightTransport,
    named_tensors: Iterable[tuple[str, Tensor]] | StagedUpdate,
    version: int | None = None,
    progress: Progress | None = None,
) -> int:
    """Send `named_tensors` (or what `sender.stage` made of them) as weight version `version`
    through `sender`; returns the new version.
    On any failure the update is aborted and the error re-raised, with a note when the engines
    could not go back to their old weights (e.g. after sleep)."""
    progress = progress if progress is not None else UpdateProgress()  # type: Progress
    try:
        await sender.begin(client)
        for chunk in sender.chunks(named_tensors):
            await sender.send_chunk(client, chunk)
            progress.chunks += 1
            progress.bytes += chunk.payload_bytes
        return await sender.finish(client, version)
    except BaseException as err:
        try:
            progress.restored = await sender.abort(client)
        except Exception as abort_err:
            progress.restored = False
            err.add_note(f"aborting the weight update failed too: {abort_err}")
        if not progress.restored:
            err.add_note("the engines could not go back to their pre-update weights (after sleep they are "
                         "dropped); they stay unable to run until a complete update lands")
        raise
