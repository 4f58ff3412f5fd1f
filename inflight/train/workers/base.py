"""PolicyWorker: everything the training backends share, including THE executor of a weight sync.

A backend (FSDP, Megatron, a plain single-process model) supplies only how to build its model,
how to compute token log-probabilities (and, if it needs to, its own forward/backward and
optimizer step), and how to produce full HF-named tensors from its shards
(`iter_full_hf_tensors`). Everything else lives here once: the micro-batched training step, the
cross-rank agreement on a sync's outcome, and `sync_weights`, which executes a `SyncPlan` as
straight-line code. No backend decides anything about a sync: the plan does
(`inflight.weight_sync.plan_weight_sync`), and this file carries it out.

Every rank calls `sync_weights` (gathering full tensors is a collective); rank 0
talks to the engines, the other ranks only take part in the gathers.
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import torch
import torch.distributed as dist
from torch.optim.lr_scheduler import LRScheduler

from inflight.client.base import InferenceClient
from inflight.client.update import update_all_or_nothing
from inflight.config import Config
from inflight.train.batch import TrainBatch
from inflight.train.losses import LossFn, token_mean_nll_loss
from inflight.train.lr_schedule import make_lr_scheduler
from inflight.train.objective import training_temperature
from inflight.weight_sync.inprocess import InProcessTransport
from inflight.weight_sync.plan import SyncPlan
from inflight.weight_sync.transport import WeightTransport

log = logging.getLogger(__name__)
T = TypeVar("T")


class WeightSyncError(RuntimeError):
    """A weight sync failed (raised on the ranks other than 0 when rank 0's sync failed)."""


@dataclass
class SyncReport:
    """What one sync did: outcome, engine weight version afterwards, timings and volume.

    `timings` holds `stage_s` (the transport's `stage`, before the pause: the shm transport packs
    the update there, gathering it), `pause_s` (generation paused: from the pause call until resume
    returned), `send_s` (the send_weights step: gathering, moving and loading what was not staged),
    `total_s` (both) and one `<step>_s` entry per executed step. `restored`: after a failed send, whether the
    engines are back on their pre-update weights. `prefix_cache_empty`: what the reset call returned.
    """

    ok: bool
    version: int
    steps: tuple[str, ...] = ()
    timings: dict[str, float] = field(default_factory=dict)
    bytes: int = 0
    chunks: int = 0
    restored: bool | None = None
    prefix_cache_empty: bool | None = None


class _TensorStream:
    """The backend's tensor iterator, drainable after a failure so the other ranks finish their
    gathers. A plain iterator, not a generator: a consumer that stops early (a chunker closed by an
    exception) must not close the backend's generator, or the drain would have nothing to drain."""

    def __init__(self, tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
        self._tensors = iter(tensors)
        self.done = False
        self.failed = False

    def __iter__(self) -> _TensorStream:
        return self

    def __next__(self) -> tuple[str, torch.Tensor]:
        try:
            return next(self._tensors)
        except StopIteration:
            self.done = True
            raise
        except BaseException:
            self.failed = True
            raise

    def drain(self) -> None:
        if not (self.done or self.failed):
            for _ in self:
                pass


def move_optimizer_state(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    """Every tensor of `optimizer`'s state to `device` (the parameters stay where they are)."""
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.device != device and value.dim() > 0:
                state[key] = value.to(device, non_blocking=True)


class PolicyWorker(ABC):
    """One rank of the policy: a model, its optimizer, a training step, and the weight sync.

    Backends implement `build_model` (set `self.model`), `compute_logprobs` and
    `iter_full_hf_tensors`; they may override `build_optimizer`, `forward_backward` and
    `clip_gradients`. `loss_fn(logprobs, batch) -> scalar` is pluggable (default: token-level
    cross-entropy; the RL objective is `inflight.train.objective.rl_loss`, which may ask for the
    per-token entropy too: `wants_entropy`).
    """

    def __init__(self, cfg: Config, rank: int = 0, world_size: int = 1, loss_fn: LossFn | None = None,
                 device: str | torch.device = "cpu", model_path: str | Path | None = None,
                 role: str = "policy") -> None:
        self.cfg, self.rank, self.world_size = cfg, rank, world_size
        self.role = role
        """`policy`, `ref` or `critic`: whose settings (`trainer.<role>.*`) the model is built with."""
        self.section = getattr(cfg.trainer, role)
        self.model_path = model_path or cfg.trainer.policy.model.path  # the HF directory it builds from
        if self.model_path is None:
            raise ValueError("no model: set trainer.policy.model.path or pass model_path")
        self.loss_fn = loss_fn or token_mean_nll_loss
        self.device = torch.device(device)
        self.temperature = training_temperature(cfg)  # trainer.algorithm.temperature (null: the rollouts')
        self.model: torch.nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.lr_scheduler: LRScheduler | None = None
        self.num_training_steps: int | None = None  # the run's optimizer steps, for decaying schedules
        self.global_step = 0
        self.forward_tokens: int | None = None
        """Tokens the last `compute_logprobs` ran, padding included (None: the backend does not say;
        it ran the batch as it is)."""

    # ---- backend hooks --------------------------------------------------------------------------
    @abstractmethod
    def build_model(self) -> None:
        """Create `self.model` (sharded / parallel as the backend does it)."""

    @abstractmethod
    def compute_logprobs(
        self, batch: TrainBatch, entropy: bool = False
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """[B, T] token log-probabilities of `batch` under the current model, with gradients
        (`inflight.train.losses.token_logprobs` of the logits, at `self.temperature`); with
        `entropy`, (log-probabilities, [B, T] token entropy of the same distributions)."""

    @abstractmethod
    def iter_full_hf_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every parameter as a full (unsharded) tensor under its Hugging Face name, in the same
        order on every rank. A collective: every rank must consume it to the end. Rank 0's tensors
        are sent to the engines; other ranks may yield anything (their values are not used)."""

    def build_optimizer(self) -> None:
        """AdamW over the trainable parameters and its learning-rate schedule, from
        `trainer.policy.optimizer_config` (decaying schedules over `num_training_steps`)."""
        opt = self.section.optimizer_config
        self.optimizer = torch.optim.AdamW(
            self.optimizer_parameters(), lr=opt.lr, betas=tuple(opt.adam_betas), weight_decay=opt.weight_decay
        )
        self.lr_scheduler = make_lr_scheduler(self.optimizer, opt.scheduler, opt.num_warmup_steps,
                                              self.num_training_steps)

    def optimizer_parameters(self) -> list[torch.nn.Parameter]:
        """What the optimizer steps and the gradient norm is taken over: the model's parameters
        that require gradients (a backend with float32 master copies of them returns those)."""
        return [p for p in self.model.parameters() if p.requires_grad]

    def forward_backward(self, batch: TrainBatch, scale: float) -> dict[str, float]:
        """Accumulate the gradient of `scale * loss_fn(logprobs, batch)` (and `entropy=` when the
        loss wants it); returns metrics."""
        if getattr(self.loss_fn, "wants_entropy", False):
            logprobs, entropy = self.compute_logprobs(batch, entropy=True)
            loss = self.loss_fn(logprobs, batch, entropy=entropy)
        else:
            loss = self.loss_fn(self.compute_logprobs(batch), batch)
        (loss * scale).backward()
        return {"loss": float(loss.detach())}

    def optimizer_step(self) -> dict[str, float]:
        """Clip the gradient norm, step, zero the gradients, advance the learning-rate schedule;
        returns the pre-clip norm and the learning rate used."""
        norm = self.clip_gradients(self.section.optimizer_config.max_grad_norm)
        offload = self.offloads_optimizer()
        if offload:
            move_optimizer_state(self.optimizer, self.device)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if offload:
            move_optimizer_state(self.optimizer, torch.device("cpu"))
        return {"grad_norm": norm, **self.advance_lr()}

    def offloads_optimizer(self) -> bool:
        """`optimizer_config.offload_after_step` in a colocated run on CUDA: the AdamW state waits in
        host memory between steps, so the engines get the device while they generate (on CPU it
        already is in host memory)."""
        return (self.section.optimizer_config.offload_after_step and self.cfg.trainer.placement.colocate_all
                and self.device.type == "cuda")

    def clip_gradients(self, max_norm: float) -> float:
        """Scale the gradients to a norm of at most `max_norm`; returns the norm before clipping."""
        norm = torch.nn.utils.clip_grad_norm_(self.optimizer_parameters(), max_norm)
        if hasattr(norm, "full_tensor"):  # a DTensor from sharded parameters
            norm = norm.full_tensor()
        return float(norm)

    def advance_lr(self) -> dict[str, float]:
        """After an optimizer step: the learning rate it used (`lr`), and the schedule moved on. An
        optimizer put in place of the built one keeps its own rate (the schedule was the other's)."""
        if self.lr_scheduler is not None and self.lr_scheduler.optimizer is not self.optimizer:
            self.lr_scheduler = None
        lr = float(self.optimizer.param_groups[0]["lr"])
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
        return {"lr": lr}

    def agree(self, ok: bool, version: int) -> tuple[bool, int]:
        """Rank 0's sync outcome on every rank (a broadcast on the trainer's default group)."""
        if self.world_size == 1 or not dist.is_initialized():
            return ok, version
        device = self.device if dist.get_backend() == "nccl" else torch.device("cpu")
        flag = torch.tensor([int(ok), version], dtype=torch.int64, device=device)
        dist.broadcast(flag, src=0)
        return bool(flag[0]), int(flag[1])

    # ---- common -----------------------------------------------------------------------------------
    def setup(self) -> PolicyWorker:
        """Build the model and the optimizer; returns self."""
        torch.manual_seed(self.cfg.trainer.seed)
        self.build_model()
        if self.optimizer is None:
            self.build_optimizer()
        return self

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """One optimizer step over this rank's `batch`, in micro-batches of
        `trainer.micro_train_batch_size_per_gpu` (gradients accumulated, each scaled by 1/count),
        each trimmed to its longest row. With several ranks, each must get the same number of
        sequences."""
        self.model.train()
        micro = self.cfg.trainer.micro_train_batch_size_per_gpu
        parts = [part.trimmed() for part in batch.to(self.device).split(micro)]
        losses = [self.forward_backward(part, 1.0 / len(parts))["loss"] for part in parts]
        metrics = {"loss": sum(losses) / len(losses), **self.optimizer_step()}
        self.global_step += 1
        return metrics

    @torch.no_grad()
    def logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """Token log-probabilities without gradients (e.g. for old or reference logprobs)."""
        self.model.eval()
        return self.compute_logprobs(batch.to(self.device)).detach()

    @torch.no_grad()
    def load_hf_state(self, named_tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
        """Overwrite parameters from full HF-named tensors (another worker's `iter_full_hf_tensors`
        of the same model: `update_ref_every_epoch`); every name must be a parameter of this model."""
        params = dict(self.model.named_parameters())
        for name, tensor in named_tensors:
            if name not in params:
                raise KeyError(f"{name!r} is not a parameter of the {self.role} model")
            params[name].copy_(tensor)

    def iter_sync_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """What a weight sync sends (HF names; a collective like `iter_full_hf_tensors`): the full
        weights, or a LoRA policy's adapter (`inflight.train.lora.adapter_tensors`). A plan whose
        engines sleep (`SyncPlan.full_weights`) sends `iter_full_hf_tensors` instead."""
        return self.iter_full_hf_tensors()

    def full_hf_state_dict(self) -> dict[str, torch.Tensor]:
        """The full HF-named state (CPU copies). A collective: call it on every rank."""
        return {name: t.detach().to("cpu", copy=True) for name, t in self.iter_full_hf_tensors()}

    # ---- the sync executor ------------------------------------------------------------------------
    async def sync_weights(self, client: InferenceClient | None, plan: SyncPlan, version: int,
                           transport: WeightTransport | None = None) -> SyncReport:
        """Execute `plan` against the engines behind `client`, sending this model's weights as
        weight version `version` through `transport` (default: in-process, via the client).

        pause (plan.pause_mode) -> sleep (plan.offload_kv) -> wake weights -> send weights in
        chunks -> wake KV -> reset (reset_prefix_cache(reset_running_requests=...)), each only where
        the plan has it, and resume in `finally`. If the send fails, the update is aborted so the
        engines go back to their pre-update weights (version unchanged), generation resumes, and the
        error is re-raised; where the old weights are gone (the engines slept), they stay paused
        until a complete update lands, and the error says so. Every rank must call this; only rank
        0 uses `client` and `transport`.
        """
        stream = _TensorStream(self.iter_full_hf_tensors() if plan.full_weights else self.iter_sync_tensors())
        if self.rank != 0:
            stream.drain()
            ok, new_version = self.agree(True, version)
            if not ok:
                raise WeightSyncError(f"rank 0 failed to sync weight version {version} to the engines")
            return SyncReport(ok=True, version=new_version)
        try:
            report = await _execute(client, plan, version, transport or InProcessTransport(), stream)
        except BaseException:
            stream.drain()
            self.agree(False, version)
            raise
        self.agree(True, report.version)
        return report


async def _step(report: SyncReport, name: str, call: Awaitable[T]) -> T:
    """Await one step of the sync, recording its time and its name in `report`."""
    began = time.perf_counter()
    result = await call
    report.timings[f"{name}_s"] = time.perf_counter() - began
    report.steps += (name,)
    return result


async def _execute(client: InferenceClient, plan: SyncPlan, version: int, transport: WeightTransport,
                   stream: _TensorStream) -> SyncReport:
    """The plan's steps in order, each only where the plan has it (docs/design.md section 4)."""
    report = SyncReport(ok=False, version=version - 1)
    began = time.perf_counter()
    update = await transport.stage(stream)  # before the pause: the engines still generate meanwhile
    report.timings["stage_s"] = time.perf_counter() - began
    start = time.perf_counter()
    kv_asleep = False
    failure: BaseException | None = None
    try:
        await _step(report, "pause", client.pause(plan.pause_mode))
        if plan.sleeps:
            kv_asleep = True
            await _step(report, "sleep", client.sleep(offload_kv=plan.offload_kv))
        if plan.wakes:
            await _step(report, "wake_up_weights", client.wake_up(["weights"]))
        send = update_all_or_nothing(client, transport, update, version, progress=report)
        report.version = await _step(report, "send_weights", send)
        if plan.wakes:
            await _step(report, "wake_up_kv_cache", client.wake_up(["kv_cache"]))
            kv_asleep = False
        if plan.resets:
            reset = client.reset_prefix_cache(reset_running_requests=plan.reset_running_requests)
            report.prefix_cache_empty = await _step(report, "reset", reset)
        report.ok = True
    except BaseException as err:
        failure = err
        if kv_asleep:  # the KV pool (offloaded or discarded) must be back before anything runs
            try:
                await client.wake_up(["kv_cache"])
            except Exception as wake_err:
                err.add_note(f"waking the KV cache after the failure failed too: {wake_err}")
        raise
    finally:
        await _resume(client, failure, report)  # also when the pause itself failed half-way
        # the pause is the first step: generation was paused for the whole sync
        report.timings["pause_s"] = time.perf_counter() - start
        report.timings["total_s"] = time.perf_counter() - began
        report.timings.setdefault("send_s", report.timings.get("send_weights_s", 0.0))
    if report.prefix_cache_empty is False:
        log.warning("the prefix cache still holds blocks after the sync's reset (requests hold them)")
    return report


async def _resume(client: InferenceClient, failure: BaseException | None, report: SyncReport) -> None:
    try:
        await _step(report, "resume", client.resume())
    except Exception as err:
        if failure is None:
            raise
        failure.add_note(f"the engines stay paused ({err}); they resume once a complete update lands")
