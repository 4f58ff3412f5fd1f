"""LocalPolicy: the trained policy of a run, in one process — the policy worker, the shared
training step, the weight sync to the engines (one plan, `plan_weight_sync(cfg)`) and checkpoints.

The trainers talk to the policy only through `train`, `sync_weights`, `save`, `export` and
`weight_version`, so the same object serves in the trainer's own process and inside a Ray actor
(`inflight.cluster`, where every rank holds one and only rank 0 has a client).
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from inflight.client.base import InferenceClient
from inflight.config import Config
from inflight.config.job import JobConfig
from inflight.orchestration.server_fleet import free_port
from inflight.orchestration.thread_lending import ThreadLending
from inflight.rollout.task_generator import TrajectoryGroup
from inflight.train.checkpoint import CheckpointState, export_model, load_optimizer, save_checkpoint
from inflight.train.lora import lora_enabled
from inflight.train.moe_support import check_worker_supports
from inflight.train.objective import uses_reference
from inflight.train.step import TrainingStep
from inflight.train.strategies import pick_strategy
from inflight.train.vision import raise_vision_settings
from inflight.train.workers.base import PolicyWorker, SyncReport
from inflight.weight_sync.inprocess import InProcessTransport
from inflight.weight_sync.plan import KVFate, plan_weight_sync
from inflight.weight_sync.transport import WeightTransport


def ensure_process_group(device: str = "cpu", init_method: str | None = None, rank: int = 0,
                         world_size: int = 1) -> None:
    """The policy ranks' torch.distributed group (nccl on CUDA, else gloo) when none was launched;
    by default one rank, for the FSDP / Megatron workers of a one-process run."""
    if not dist.is_initialized():
        backend = "nccl" if torch.device(device).type == "cuda" else "gloo"
        init_method = init_method or f"tcp://127.0.0.1:{free_port()}"
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size)


def make_worker(cfg: Config, job: JobConfig, model_dir: str | Path, training_steps: int | None = None,
                role: str = "policy") -> PolicyWorker:
    """The policy worker the job asks for (see `JobConfig.worker`), not yet set up, knowing the
    run's optimizer steps (for a decaying learning-rate schedule); `role="ref"` builds the
    reference model with `trainer.ref`'s settings, `role="critic"` the critic (`inflight.train.critic`)
    with `trainer.critic`'s."""
    entry = pick_strategy(cfg.trainer.strategy, job.worker, dist.is_initialized())
    check_worker_supports(cfg, model_dir, entry.name, role)  # MoE models and routing replay, before any start
    if role == "policy":
        raise_vision_settings(cfg, model_dir, entry.name)  # a vision-language policy's LoRA and worker
    Worker = entry.worker_class(role)
    if entry.distributed:
        ensure_process_group(job.trainer_device)
    worker = Worker(cfg, model_path=str(model_dir), device=job.trainer_device, role=role)
    mini = cfg.trainer.critic_mini_batch_size if role == "critic" else None
    worker.num_training_steps = optimizer_steps(cfg, training_steps, mini)
    return worker


def run_training_steps(cfg: Config, num_prompts: int) -> int:
    """The run's training steps, as SkyRL 0.3.0 counts them (its trainers' `total_training_steps`):
    `trainer.epochs` passes of `num_prompts // train_batch_size` steps (at least one), capped at
    `trainer.max_training_steps` when set (a cap: it never adds steps past the epochs)."""
    trainer = cfg.trainer
    steps = trainer.epochs * max(1, num_prompts // trainer.train_batch_size)
    return steps if trainer.max_training_steps is None else min(steps, trainer.max_training_steps)


def optimizer_steps(
    cfg: Config, training_steps: int | None, mini_batch_size: int | None = None
) -> int | None:
    """The run's optimizer steps: `training_steps` training steps (default `trainer.max_training_steps`),
    each one per mini-batch (of `policy_mini_batch_size` prompts, or `mini_batch_size`: the critic's)
    and pass; None when unknown."""
    steps = training_steps if training_steps is not None else cfg.trainer.max_training_steps
    if steps is None:
        return None
    trainer = cfg.trainer
    mini = trainer.policy_mini_batch_size if mini_batch_size is None else mini_batch_size
    per_step = max(1, trainer.train_batch_size // mini) * trainer.update_epochs_per_batch
    return steps * per_step


async def engines_version(client: InferenceClient) -> int:
    """The highest weight version among the engines behind `client` (they differ while a restarted
    engine waits for its first sync; `weight_version()` refuses to answer then)."""
    versions = getattr(client, "weight_versions", None)  # a FanOutClient's, per engine
    if versions is not None:
        return max(int(v) for v in (await versions()).values())
    return int(await client.weight_version())


TRAIN_THREAD_NAME = "policy-train"
"""Name prefix of the thread every `LocalPolicy.train` step runs on."""


class LocalPolicy:
    """One policy rank in this process: its worker (+ the reference of the KL terms, + the critic of
    `gae`), the training step, and the weight sync to the engines behind `client` through `transport`.

    Only rank 0 needs a client (and a transport); the other ranks take part in the sync's gathers.
    `timings` holds the last sync's timings, `history` every sync's, `failed_syncs` the count of
    syncs that raised.
    """

    def __init__(
        self,
        cfg: Config,
        worker: PolicyWorker,
        client: InferenceClient | None,
        transport: WeightTransport | None = None,
        *,
        version: int = 0,
        step_fn: TrainingStep | None = None,
        reference: PolicyWorker | None = None,
        base_model_dir: str | Path | None = None,
        critic: PolicyWorker | None = None,
        lending: ThreadLending | None = None,
    ) -> None:
        if worker.rank == 0 and client is None:
            raise ValueError("the process holding rank 0 needs an inference client")
        self.cfg, self.worker, self.client = cfg, worker, client
        self.transport = transport if transport is not None else InProcessTransport()
        self.plan = plan_weight_sync(cfg)
        self.weight_version = version
        self.step_fn, self.reference, self.critic = step_fn, reference, critic
        self.training_step = step_fn  # what checkpoints read, also while a caller wraps `step_fn`
        self.base_model_dir = None if base_model_dir is None else str(base_model_dir)
        self.timings: dict[str, float] = {}
        self.history: list[dict[str, float]] = []
        self.failed_syncs = 0
        # one named thread for every training step: the step's thread-local state (its torch threads)
        # stays put, and a placement (bench rl's) can find it and give it a core of its own
        self._train_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix=TRAIN_THREAD_NAME)
        # the step's torch threads, and the engines' lent to it (`inflight.orchestration.thread_lending`)
        self.lending = lending if lending is not None else ThreadLending(torch.get_num_threads())
        self._follow_lending = False  # steps follow a lending that changes while they run

    @classmethod
    def load(
        cls,
        cfg: Config,
        job: JobConfig,
        pad_id: int,
        model_dir: str | Path,
        client: InferenceClient | None,
        transport: WeightTransport | None,
        version: int,
        ckpt: CheckpointState | None = None,
        training_steps: int | None = None,
        lending: ThreadLending | None = None,
    ) -> LocalPolicy:
        """Load the worker from `model_dir` (the checkpoint's on resume, with its optimizer state;
        a LoRA policy's is the base model, and the checkpoint's adapter is loaded into it), the
        reference and the critic (the checkpoint's when it holds them) and the training step; the
        base model is `trainer.policy.model.path`. `training_steps`: the run's (`run_training_steps`),
        over which a decaying learning-rate schedule runs; `lending`: the step's threads (default
        `job.threads`, none lent)."""
        torch.set_num_threads(job.threads)
        base_model_dir = cfg.trainer.policy.model.path
        worker = make_worker(cfg, job, model_dir, training_steps).setup()

        def saved(name: str) -> Path | None:  # a model the checkpoint holds (critic/, ref/)
            return ckpt.path / name if ckpt is not None and (ckpt.path / name).is_dir() else None

        reference = None
        if uses_reference(cfg):
            ref_dir = saved("ref") or cfg.trainer.ref.model.path or base_model_dir
            reference = make_worker(cfg, job, ref_dir, role="ref")
            reference.build_model()
        critic = None
        if cfg.trainer.critic.model.path:
            critic = make_worker(cfg, job, saved("critic") or cfg.trainer.critic.model.path, training_steps,
                                 role="critic").setup()
        step_fn = TrainingStep(worker, cfg, pad_id, reference=reference, critic=critic)
        if ckpt is not None:
            if lora_enabled(cfg):  # the worker holds the base model: the checkpoint's adapter goes in
                worker.load_adapter(ckpt.path / "adapter")
            load_optimizer(worker, ckpt)
            worker.global_step = ckpt.step
            if critic is not None and saved("critic") is not None:
                load_optimizer(critic, ckpt, prefix="critic_")
            step_fn.load_state(ckpt.algorithm)
        return cls(
            cfg,
            worker,
            client,
            transport,
            version=version,
            step_fn=step_fn,
            reference=reference,
            base_model_dir=base_model_dir,
            critic=critic,
            lending=lending or ThreadLending(job.threads),
        )

    @property
    def kv_fate(self) -> KVFate:
        """What the sync does to the KV of requests in flight (the plan's)."""
        return self.plan.kv_fate

    def follow_lending(self, follow: bool = True) -> ThreadLending:
        """Have every step follow `lending` while it runs (the fully-async trainer lends and takes
        back the engines' threads during a step); returns it."""
        self._follow_lending = follow
        return self.lending

    async def train(self, groups: list[TrajectoryGroup], policy_version: int) -> dict[str, Any]:
        """One training step, on the policy's training thread (`TRAIN_THREAD_NAME`), so the caller's
        event loop keeps running, with the torch threads `lending` gives it."""
        loop = asyncio.get_running_loop()
        run = contextvars.copy_context().run  # as asyncio.to_thread does
        step = functools.partial(
            self.lending.run, self.step_fn, groups, policy_version, follow=self._follow_lending
        )
        return await loop.run_in_executor(self._train_thread, run, step)

    async def sync_weights(self) -> SyncReport:
        """Push the current weights to the engines as the next weight version, following the plan.
        Returns rank 0's report (on other ranks: outcome and version only); raises when the sync
        failed (the engines then keep their old weights where they could restore them)."""
        started = time.perf_counter()
        base = self.weight_version
        if self.worker.rank == 0:
            base = max(base, await engines_version(self.client))
        try:
            report = await self.worker.sync_weights(self.client, self.plan, base + 1, self.transport)
        except BaseException:
            self.failed_syncs += 1
            raise
        self.weight_version = report.version
        self.timings = {**report.timings, "sync_s": time.perf_counter() - started,
                        "version": report.version, "bytes": report.bytes, "chunks": report.chunks}
        send = report.timings.get("send_s", 0.0)
        if send > 0 and report.bytes:
            self.timings["send_bytes_per_s"] = report.bytes / send
        self.history.append(self.timings)
        return report

    async def export(self, root: str | Path, step: int) -> str:
        """The policy as a Hugging Face model under `root` (`checkpoint.export_model`); its path."""
        path = await asyncio.to_thread(export_model, self.worker, self.base_model_dir, root, step)
        return str(path)

    async def save(
        self, root: str | Path, step: int, data: dict[str, Any], extra: dict[str, Any], keep: int
    ) -> str:
        """A checkpoint of the worker at `step` (with the data loader's state `data`, the critic, the
        reference once `update_ref_every_epoch` changed it, and the step's algorithm state); its path."""
        training = self.training_step
        reference = self.reference if training is not None and training.ref_epoch > 0 else None
        extras = {"critic": self.critic, "reference": reference,
                  "algorithm": training.state() if training is not None else {}}
        path = await asyncio.to_thread(save_checkpoint, root, step, self.worker, self.base_model_dir,
                                       self.weight_version, data, extra, keep, **extras)
        return str(path)
