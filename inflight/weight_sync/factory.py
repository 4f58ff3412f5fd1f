"""The weight transport a config asks for, both ends.

`generator.inference_engine.weight_sync_backend` picks the kind (`configured_transport`: a
registered `TransportSpec`, SkyRL's `nccl` / `gloo` / `cuda_ipc` read as `broadcast` / `broadcast` /
`shm`), `weight_sync_host` / `weight_sync_port` say where the trainer's sender listens, and
`weight_sync_chunk_size_mb` bounds a chunk (None: sized from the model), `weight_sync_staged` has
the shm sender pack an update before the pause. `make_transport` builds the kind's sender (trainer
rank 0); the engine side is the spec's `build_receiver`, connecting to it.
"""

from __future__ import annotations

from pathlib import Path

import torch

from inflight.config import Config
from inflight.weight_sync.chunking import DEFAULT_CHUNK_BYTES
from inflight.weight_sync.kinds import SHM, SenderSite, TransportSpec, transport_spec
from inflight.weight_sync.transport import WeightTransport

MIB = 1 << 20
_AUTO_MIN, _AUTO_MAX = 16 * MIB, 256 * MIB


def configured_transport(cfg: Config) -> TransportSpec:
    """The spec of the configured `weight_sync_backend` (a ValueError names the key and the known kinds)."""
    name = cfg.generator.inference_engine.weight_sync_backend
    try:
        return transport_spec(name)
    except ValueError as err:
        raise ValueError(f"generator.inference_engine.weight_sync_backend={name!r}: {err}") from None


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
    if configured_transport(cfg) is SHM:  # SkyRL's threshold is cuda_ipc's, which shm stands for
        auto = min(auto, max(MIB, int(ie.weight_transfer_threshold_cuda_ipc_GB * 1024 * MIB)))
    return auto


def make_transport(cfg: Config, *, model_dir: str | Path | None = None, host: str | None = None,
                   device: str | torch.device = "cpu", num_receivers: int = 1,
                   timeout: float = 600.0) -> WeightTransport:
    """The sending side of the configured transport (its spec's `build_sender`).

    `host` overrides `weight_sync_host` (e.g. the node's address under Ray); `device` is where the
    broadcast buffer lives (nccl on CUDA, gloo otherwise). `num_receivers`: engine ranks that will
    connect (shm and broadcast).
    """
    ie = cfg.generator.inference_engine
    site = SenderSite(
        host or ie.weight_sync_host,
        ie.weight_sync_port,
        num_receivers,
        chunk_bytes(cfg, model_dir),
        device=device,
        timeout=timeout,
        staged=ie.weight_sync_staged,
    )
    return configured_transport(cfg).build_sender(site)
