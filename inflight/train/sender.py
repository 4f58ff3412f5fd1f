"""Policy rank 0's weight sender (`make_sender`) and where each engine's receiver connects to it
(`receiver_spec`); a shared-memory buffer is named after the trainer's pid, so a later run can
remove the buffers of a trainer that was killed (`remove_stale_shm_buffers`)."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

from inflight.client.process import ReceiverSpec
from inflight.config import Config
from inflight.config.implemented import on_servers
from inflight.weight_sync import make_transport, transport_kind
from inflight.weight_sync.factory import chunk_bytes
from inflight.weight_sync.inprocess import InProcessTransport
from inflight.weight_sync.shm import SHM_DIR
from inflight.weight_sync.transport import ChannelTransport, WeightTransport

SHM_PREFIX = "inflight-weights-train-"


def remove_stale_shm_buffers() -> None:
    """Unlink the shared-memory weight buffers of trainers that died without cleaning up (killed):
    their file names carry the trainer's pid."""
    for path in SHM_DIR.glob(SHM_PREFIX + "*"):
        try:
            pid = int(path.name[len(SHM_PREFIX):].split("-", 1)[0])
            os.kill(pid, 0)
        except ProcessLookupError:  # that trainer is gone
            path.unlink(missing_ok=True)
        except (ValueError, PermissionError):  # no pid in the name; alive, someone else's
            pass


def make_sender(cfg: Config, model_dir: str | Path, device: str = "cpu",
                host: str | None = None) -> WeightTransport:
    """Policy rank 0's weight sender to all `num_engines` engines (`make_transport`); a shared
    buffer is named after this process, so a later run can remove it if this one gets killed.
    HTTP servers take their chunks through the client (`RemoteClient(shm_chunks=...)` says whether
    in request bodies or as /dev/shm files), so for them the sender hands chunks to the client."""
    if on_servers(cfg):
        return InProcessTransport(max_chunk_bytes=chunk_bytes(cfg, model_dir))
    path = None
    if transport_kind(cfg) == "shm":
        remove_stale_shm_buffers()
        path = str(SHM_DIR / f"{SHM_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}")
    return make_transport(cfg, model_dir=model_dir, host=host, device=device,
                          num_receivers=cfg.generator.inference_engine.num_engines, path=path)


def receiver_spec(sender: ChannelTransport, backend: str, device: str, index: int, num_engines: int) -> ReceiverSpec:
    """Where engine `index` (of `num_engines`) connects its weight receiver to `sender`."""
    return ReceiverSpec(backend, sender.channel.host, sender.port, device, index + 1, num_engines)
