"""The GPU-count keys against the CUDA devices of this node, checked before anything starts.

SkyRL's placement keys count GPUs per node: `trainer.placement.policy_num_gpus_per_node` (and the
critic's and reference's), and an engine takes `tensor_parallel_size` GPUs. Where the run's devices
are CUDA, a count beyond `torch.cuda.device_count()` is refused with the key and both numbers,
instead of a rank or an engine failing to find its device minutes later; so is a device key that
names a GPU the node lacks (`cuda:N`, N >= the count). The policy's keys count
on every node alike; the engines count on this node when it starts them all (not under Ray, which
places them across the cluster, nor for servers started elsewhere). On CPU a policy rank is a
process and an engine a thread pool: nothing to count.
"""

from __future__ import annotations

from inflight.config import Config
from inflight.config.job import JobConfig

_PLACEMENT = "trainer.placement."
_IE = "generator.inference_engine."


def gpu_demands(cfg: Config, job: JobConfig) -> dict[str, int]:
    """{key (as a user sets it): the GPUs it asks of one node} for what runs on CUDA."""
    placement, ie = cfg.trainer.placement, cfg.generator.inference_engine
    demands: dict[str, int] = {}
    if job.trainer_device.startswith("cuda"):
        demands |= {
            _PLACEMENT + name: getattr(placement, name)
            for name in ("policy_num_gpus_per_node", "critic_num_gpus_per_node", "ref_num_gpus_per_node")
        }
    if ie.device.startswith("cuda") and ie.run_engines_locally and not job.ray:
        demands[f"{_IE}num_engines * {_IE}tensor_parallel_size"] = ie.num_engines * ie.tensor_parallel_size
    return demands


def named_devices(cfg: Config, job: JobConfig) -> dict[str, tuple[str, int]]:
    """{key: (its device, the GPU index it names)} of the device keys that name one (`cuda:N`)."""
    devices = {
        _IE + "device": cfg.generator.inference_engine.device,
        "job.trainer_device": job.trainer_device,
    }
    return {key: (d, int(d.split(":", 1)[1])) for key, d in devices.items()
            if d.startswith("cuda:") and d.split(":", 1)[1].isdigit()}


def too_many_gpus(cfg: Config, job: JobConfig, device_count: int | None = None) -> str | None:
    """Why the GPU-count keys ask for more CUDA devices than this node has (`device_count`, default
    `torch.cuda.device_count()`), naming each key with both numbers; None when they fit (or nothing
    runs on CUDA)."""
    demands, named = gpu_demands(cfg, job), named_devices(cfg, job)
    if not demands and not named:
        return None
    if device_count is None:
        import torch

        device_count = torch.cuda.device_count()
    over = [f"{key}={wanted} asks for {wanted} GPUs, but this node has {device_count} "
            "(torch.cuda.device_count())" for key, wanted in demands.items() if wanted > device_count]
    over += [f"{key}={device} names GPU {index}, but this node has {device_count} (cuda:0 to "
             f"cuda:{device_count - 1})" for key, (device, index) in named.items() if index >= device_count]
    if not over:
        return None
    return "; ".join(over) + "; fit the keys to this node's GPUs, or run on a node with more"
