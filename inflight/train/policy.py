"""LocalPolicy: the trained policy of a run, in one process — the policy worker, the shared
training step, the dispatch that syncs weights to the engines, and checkpoints.

The trainers talk to the policy only through `train`, `sync`, `save` and `weight_version`, so the
same object serves in the trainer's own process and inside a Ray actor (`inflight.cluster`).
"""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path
from typing import Any

import torch

from inflight.config import Config
from inflight.rollout.generator import TrajectoryGroup
from inflight.train.checkpoint import CheckpointState, load_optimizer, save_checkpoint
from inflight.train.dispatch import WorkerDispatch
from inflight.train.job_config import JobConfig
from inflight.train.step import StepOptions, TrainingStep
from inflight.train.workers.base import PolicyWorker


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ensure_process_group(device: str = "cpu") -> None:
    """A one-rank torch.distributed group for the FSDP / Megatron workers when none was launched."""
    import torch.distributed as dist

    if not dist.is_initialized():
        backend = "nccl" if torch.device(device).type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)


def make_worker(cfg: Config, job: JobConfig, model_dir: str | Path) -> PolicyWorker:
    """The policy worker the job asks for (see `JobConfig.worker`), not yet set up, knowing the
    run's optimizer steps (for a decaying learning-rate schedule)."""
    worker = _new_worker(cfg, job, model_dir)
    worker.num_training_steps = optimizer_steps(cfg, job)
    return worker


def optimizer_steps(cfg: Config, job: JobConfig) -> int | None:
    """The run's optimizer steps: `job.max_steps` training steps, each one per mini-batch and pass."""
    if job.max_steps is None:
        return None
    trainer = cfg.trainer
    per_step = max(1, trainer.train_batch_size // trainer.policy_mini_batch_size) * trainer.update_epochs_per_batch
    return job.max_steps * per_step


def _new_worker(cfg: Config, job: JobConfig, model_dir: str | Path) -> PolicyWorker:
    import torch.distributed as dist

    kind = job.worker
    if kind == "auto":
        kind = "megatron" if cfg.trainer.strategy == "megatron" else ("fsdp" if dist.is_initialized() else "local")
    if kind == "local":
        from inflight.train.workers.local import LocalPolicyWorker

        return LocalPolicyWorker(cfg, model_path=str(model_dir), device=job.trainer_device)
    ensure_process_group(job.trainer_device)
    if kind == "fsdp":
        from inflight.train.workers.fsdp import FSDPPolicyWorker

        return FSDPPolicyWorker(cfg, model_path=str(model_dir), device=job.trainer_device)
    from inflight.train.workers.megatron import MegatronPolicyWorker

    return MegatronPolicyWorker(cfg, model_path=str(model_dir), device=job.trainer_device)


class LocalPolicy:
    """The policy worker (+ reference for the KL penalty), `TrainingStep` and `WorkerDispatch`."""

    def __init__(self, cfg: Config, job: JobConfig, pad_id: int) -> None:
        self.cfg, self.job, self.pad_id = cfg, job, pad_id
        self.worker: PolicyWorker | None = None
        self.reference: PolicyWorker | None = None
        self.dispatch: WorkerDispatch | None = None
        self.step_fn: Any = None
        self.base_model_dir: str | None = None

    def setup(
        self,
        model_dir: str | Path,
        base_model_dir: str | Path,
        client: Any,
        transport: Any,
        version: int,
        ckpt: CheckpointState | None = None,
    ) -> LocalPolicy:
        """Load the worker from `model_dir` (the checkpoint's on resume, with its optimizer state)."""
        cfg, job = self.cfg, self.job
        torch.set_num_threads(job.threads)
        self.base_model_dir = str(base_model_dir)
        self.worker = make_worker(cfg, job, model_dir).setup()
        if cfg.trainer.algorithm.use_kl_loss:
            self.reference = make_worker(cfg, job, base_model_dir)
            self.reference.build_model()
        self.dispatch = WorkerDispatch([self.worker], client, transport, cfg)
        self.dispatch.weight_version = version
        self.step_fn = TrainingStep(self.worker, cfg, self.pad_id, StepOptions.from_config(cfg), self.reference)
        if ckpt is not None:
            load_optimizer(self.worker, ckpt)
            self.worker.global_step = ckpt.step
        return self

    @property
    def weight_version(self) -> int:
        return self.dispatch.weight_version

    @property
    def kv_fate(self) -> str:
        return self.dispatch.plan.kv_fate

    async def train(self, groups: list[TrajectoryGroup], policy_version: int) -> dict[str, Any]:
        """One training step (in a worker thread, so the caller's event loop keeps running)."""
        return await asyncio.to_thread(self.step_fn, groups, policy_version)

    async def sync(self) -> dict[str, Any]:
        """Push the weights to the engines as the next version; returns version and timings."""
        report = await self.dispatch.save_weights_for_sampler()
        return {"version": report.version, "timings": dict(report.timings), "steps": list(report.steps)}

    async def save(self, root: str | Path, step: int, data: dict[str, Any], extra: dict[str, Any], keep: int) -> str:
        path = await asyncio.to_thread(save_checkpoint, root, step, self.worker, self.base_model_dir,
                                       self.weight_version, data, extra, keep)
        return str(path)
