"""The weight transport a config asks for, both ends.

`generator.inference_engine.weight_sync_backend` picks the kind (`inprocess`, `shm`, `broadcast`;
SkyRL's `nccl` / `gloo` / `cuda_ipc` are read as `broadcast` / `broadcast` / `shm`),
`weight_sync_host` / `weight_sync_port` say where the trainer's sender listens, and
`weight_sync_chunk_size_mb` bounds a chunk (None: sized from the model), `weight_sync_staged` has
the shm sender pack an update before the pause. `make_transport` builds the
sender (trainer rank 0), `make_receiver` the engine side that connects to it.
"""

from __future__ import annotations

from pathlib import Path

import torch

from inflight.config import Config, canonical_weight_sync_backend
from inflight.weight_sync.broadcast import BroadcastReceiver, BroadcastTransport
from inflight.weight_sync.chunking import DEFAULT_CHUNK_BYTES
from inflight.weight_sync.inprocess import InProcessTransport
from inflight.weight_sync.receiver import ChannelReceiver
from inflight.weight_sync.shm import ShmReceiver, ShmTransport
from inflight.weight_sync.transport import WeightTransport

MIB = 1 << 20
KINDS = ("inprocess", "shm", "broadcast")
_AUTO_MIN, _AUTO_MAX = 16 * MIB, 256 * MIB


def transport_kind(cfg: Config) -> str:
    """The configured backend as one of `KINDS`."""
    kind = canonical_weight_sync_backend(cfg.generator.inference_engine.weight_sync_backend)
    if kind not in KINDS:
        raise ValueError(f"generator.inference_engine.weight_sync_backend={kind!r} is not one of "
                         f"{list(KINDS)}; set it to one of them (or SkyRL's nccl, gloo, cuda_ipc)")
    return kind


def chunk_bytes(cfg: Config, model_dir: str | Path | None = None) -> int:
    """`weight_sync_chunk_size_mb` in bytes; when it is None, a buffer holding the whole model in
    one chunk (its safetensors plus 1 MiB, within [16, 256] MiB), or 256 MiB without `model_dir`;
    for `shm` (SkyRL's `cuda_ipc`) at most `weight_transfer_threshold_cuda_ipc_GB`."""
    ie = cfg.generator.inference_engine
    if ie.weight_sync_chunk_size_mb is not None:
        return max(1, int(ie.weight_sync_chunk_size_mb * MIB))
    if model_dir is None:
        auto = DEFAULT_CHUNK_BYTES
    else:
        size = sum(f.stat().st_size for f in Path(model_dir).glob("*.safetensors"))
        auto = int(min(max(size + MIB, _AUTO_MIN), _AUTO_MAX))
    if transport_kind(cfg) == "shm":
        auto = min(auto, max(MIB, int(ie.weight_transfer_threshold_cuda_ipc_GB * 1024 * MIB)))
    return auto


def make_transport(cfg: Config, *, model_dir: str | Path | None = None, host: str | None = None,
                   device: str | torch.device = "cpu", num_receivers: int = 1, path: str | None = None,
                   timeout: float = 600.0) -> WeightTransport:
    """The sending side of the configured transport.

    `host` overrides `weight_sync_host` (e.g. the node's address under Ray); `device` is where the
    broadcast buffer lives (nccl on CUDA, gloo otherwise); `path` names the shm buffer file.
    `num_receivers`: engine ranks that will connect (shm and broadcast).
    """
    ie = cfg.generator.inference_engine
    kind, size = transport_kind(cfg), chunk_bytes(cfg, model_dir)
    host = host or ie.weight_sync_host
    if kind == "inprocess":
        return InProcessTransport(max_chunk_bytes=size)
    if kind == "shm":
        return ShmTransport(host, ie.weight_sync_port, num_receivers, size, timeout=timeout, path=path,
                            staged=ie.weight_sync_staged)
    return BroadcastTransport(host, ie.weight_sync_port, num_receivers, size, device=device, timeout=timeout)


def make_receiver(kind: str, host: str, port: int, *, rank: int = 1, num_receivers: int = 1,
                  device: str | torch.device = "cpu", timeout: float = 600.0) -> ChannelReceiver | None:
    """The engine side for a sender of `kind` at host:port; None for `inprocess` (no receiver).
    Blocks until it reaches the sender (broadcast: until the group forms), so build it in the
    thread that will `serve` the engine."""
    kind = canonical_weight_sync_backend(kind)
    if kind == "inprocess":
        return None
    if kind == "shm":
        return ShmReceiver(host, port, rank=rank, num_receivers=num_receivers, timeout=timeout)
    if kind == "broadcast":
        return BroadcastReceiver(host, port, rank=rank, num_receivers=num_receivers, device=device,
                                 timeout=timeout)
    raise ValueError(f"weight-sync receiver kind {kind!r} is not one of {list(KINDS)} (or nccl, gloo, "
                     "cuda_ipc)")
