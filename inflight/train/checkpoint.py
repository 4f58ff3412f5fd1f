"""Resumable checkpoints: model, optimizer, step, weight version and the record of consumed prompts.

Layout under `trainer.ckpt_path`:

    global_step_<k>/model/       HF directory (config, tokenizer, model.safetensors): the engine and
                                 the worker both load it on resume; a LoRA policy's has its
                                 adapters merged (the HF export)
    global_step_<k>/adapter/     a LoRA policy's adapter in peft's format (PeftModel.from_pretrained)
    global_step_<k>/optimizer_rank<r>.pt   AdamW state and the learning-rate schedule's position
    global_step_<k>/critic/      the critic (`gae`): backbone + value head, as an HF directory
    global_step_<k>/critic_optimizer_rank<r>.pt   the critic's AdamW state and schedule
    global_step_<k>/ref/         the reference, once `update_ref_every_epoch` has replaced its weights
    global_step_<k>/state.json   step, weight version, data-loader record, trainer extras, the
                                 training step's algorithm state (the KL controller's coefficient,
                                 the reference's epoch)
    latest                       the name of the newest complete checkpoint

A checkpoint is written under a temporary name and renamed when complete, and `latest` is replaced
atomically, so a run killed at any moment leaves the previous checkpoint usable.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from inflight.config import ConfigError, Violation
from inflight.config.schema import TrainerConfig
from inflight.train.lora import lora_enabled
from inflight.train.workers.base import PolicyWorker

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


@dataclass
class CheckpointState:
    path: Path
    step: int
    weight_version: int
    data: dict[str, Any]
    algorithm: dict[str, Any] = field(default_factory=dict)

    @property
    def model_dir(self) -> Path:
        return self.path / "model"


def model_dtype(model_dir: str | Path) -> torch.dtype | None:
    """The dtype a Hugging Face directory's config.json declares (`dtype`, or the older
    `torch_dtype`), None when it declares none."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    name = config.get("dtype") or config.get("torch_dtype")
    dtype = getattr(torch, str(name), None) if name else None
    return dtype if isinstance(dtype, torch.dtype) else None


def save_model_dir(worker: PolicyWorker, base_model_dir: str | Path, out: Path,
                   dtype: torch.dtype | None = None) -> None:
    """The worker's full weights as an HF directory (non-weight files copied from the base model),
    floating tensors cast to `dtype` when given. A collective: every rank must call it; rank 0 writes."""
    state = worker.full_hf_state_dict()
    if worker.rank != 0:
        return
    if dtype is not None:
        state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
    out.mkdir(parents=True, exist_ok=True)
    for item in Path(base_model_dir).iterdir():
        if (
            item.is_file()
            and not item.name.endswith(WEIGHT_SUFFIXES)
            and item.name != "model.safetensors.index.json"
        ):
            shutil.copy2(item, out / item.name)
    save_file(
        {k: v.contiguous() for k, v in state.items()},
        str(out / "model.safetensors"),
        metadata={"format": "pt"},
    )


def _fresh(path: Path) -> Path:
    """`path`, emptied of what a killed run left there."""
    if path.exists():
        shutil.rmtree(path)
    return path


def _publish(tmp: Path, final: Path) -> None:
    """Put the complete `tmp` in place of `final`."""
    _fresh(final)
    os.replace(tmp, final)


def save_checkpoint(
    root: str | Path,
    step: int,
    worker: PolicyWorker,
    base_model_dir: str | Path,
    weight_version: int,
    data: dict[str, Any],
    extra: dict[str, Any] | None = None,
    keep: int = -1,
    *,
    critic: PolicyWorker | None = None,
    reference: PolicyWorker | None = None,
    algorithm: dict[str, Any] | None = None,
) -> Path:
    """Write checkpoint `global_step_<step>` under `root`; keeps the newest `keep` (-1: all, as
    `trainer.max_ckpts_to_keep`). With `critic` its model and optimizer, with `reference` its weights,
    with `algorithm` the training step's state. Returns its path. A collective: every rank calls it."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final, tmp = root / f"global_step_{step}", _fresh(root / f".global_step_{step}.tmp")
    save_model_dir(worker, base_model_dir, tmp / "model")
    tmp.mkdir(parents=True, exist_ok=True)
    if lora_enabled(worker.cfg):  # a collective (a sharded adapter is gathered); rank 0 writes
        worker.save_adapter(tmp / "adapter")
    _save_optimizer(worker, tmp / f"optimizer_rank{worker.rank}.pt")
    if critic is not None:
        save_model_dir(critic, critic.model_path, tmp / "critic")
        _save_optimizer(critic, tmp / f"critic_optimizer_rank{critic.rank}.pt")
    if reference is not None:
        save_model_dir(reference, reference.model_path, tmp / "ref")
    if worker.world_size > 1 and dist.is_initialized():
        dist.barrier()  # every rank's optimizer file is in place before rank 0 publishes
    if worker.rank == 0:
        state = {"step": step, "weight_version": weight_version, "data": data, "extra": extra or {},
                 "algorithm": algorithm or {}}
        (tmp / "state.json").write_text(json.dumps(state))
        _publish(tmp, final)
        (root / "latest.tmp").write_text(final.name)
        os.replace(root / "latest.tmp", root / "latest")  # atomically
        if keep > 0:
            steps = sorted(root.glob("global_step_*"), key=lambda p: int(p.name.rsplit("_", 1)[1]))
            for old in steps[:-keep]:
                shutil.rmtree(old, ignore_errors=True)
    return final


def _save_optimizer(worker: PolicyWorker, path: Path) -> None:
    schedule = worker.lr_scheduler.state_dict() if worker.lr_scheduler is not None else None
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"optimizer": worker.optimizer.state_dict(), "lr_scheduler": schedule}, path)


def export_model(worker: PolicyWorker, base_model_dir: str | Path, root: str | Path, step: int) -> Path:
    """`<root>/global_step_<step>/`: the policy as a Hugging Face directory in the model's own dtype
    (config.json's; a bf16 model exports half the bytes of its float32 master weights), a LoRA
    policy's with its adapters merged plus the adapter in `adapter/`. Written under a temporary
    name and renamed when complete. A collective: every rank must call it. (Checkpoints keep the
    float32 master weights, so that a resumed run continues exactly.)"""
    root = Path(root)
    final, tmp = root / f"global_step_{step}", _fresh(root / f".global_step_{step}.export.tmp")
    save_model_dir(worker, base_model_dir, tmp, model_dtype(base_model_dir))
    if lora_enabled(worker.cfg):
        worker.save_adapter(tmp / "adapter")
    if worker.rank == 0:
        _publish(tmp, final)
    return final


def resume_checkpoint(trainer: TrainerConfig) -> CheckpointState | None:
    """The checkpoint a run resumes from, as `trainer.resume_mode` says: `latest` (the newest in
    `trainer.ckpt_path`, or None when there is none), `from_path` (`trainer.resume_path`, which must be
    a complete checkpoint), null / `none` (None)."""
    if trainer.resume_mode in (None, "none"):
        return None
    if trainer.resume_mode == "latest":
        return load_latest(trainer.ckpt_path)
    path = Path(trainer.resume_path or "")
    if not trainer.resume_path or not (path / "state.json").is_file():
        raise ConfigError(
            [
                Violation(
                    "trainer.resume_path",
                    trainer.resume_path,
                    "is not a complete checkpoint (a global_step_<k> directory with state.json)",
                    "give the directory of a "
                    "checkpoint, e.g. <trainer.ckpt_path>/global_step_10, or resume_mode=latest",
                )
            ]
        )
    return load_checkpoint(path)


def resume_problem(trainer: TrainerConfig, problems: Sequence[Any]) -> Violation | None:
    """Why the run cannot resume the checkpoint `trainer.resume_mode` picks for training on
    `problems`: its record of consumed prompts is for another dataset or seed (with SkyRL's defaults,
    `ckpt_path: ~/ckpts/` and `resume_mode: latest`, a second run on other data finds the first's);
    None when it can, or when nothing is resumed. Checked before anything starts; the refusal names
    the directory and both fixes. Raises ConfigError for a `resume_path` that is no checkpoint."""
    from inflight.train.staleness import AsyncDataLoader

    ckpt = resume_checkpoint(trainer)
    if ckpt is None:
        return None
    try:  # the one rule of what a data record fits: the loader's
        AsyncDataLoader(problems, trainer.epochs, trainer.seed).load_state(ckpt.data)
    except ValueError:
        pass
    else:
        return None
    latest = trainer.resume_mode == "latest"
    key, value = (
        ("trainer.ckpt_path", trainer.ckpt_path) if latest else ("trainer.resume_path", trainer.resume_path)
    )
    record = f"{ckpt.data.get('num_items')} prompts, seed {ckpt.data.get('seed')}"
    return Violation(
        key,
        value,
        f"holds {ckpt.path.name} (step {ckpt.step}), a run on other data ({record}; this run "
        f"has {len(problems)} prompts, seed {trainer.seed}), which trainer.resume_mode="
        f"{trainer.resume_mode} would resume",
        f"give this run a {key} of its own, or set trainer.resume_mode=none to start from the model",
    )


def load_checkpoint(path: str | Path) -> CheckpointState:
    """The checkpoint in `path` (a `global_step_<k>` directory)."""
    path = Path(path)
    state = json.loads((path / "state.json").read_text())
    return CheckpointState(path, int(state["step"]), int(state["weight_version"]), state["data"],
                           state.get("algorithm", {}))


def load_latest(root: str | Path | None) -> CheckpointState | None:
    """The newest complete checkpoint under `root`, or None."""
    if root is None or not (pointer := Path(root) / "latest").is_file():
        return None
    state_file = Path(root) / pointer.read_text().strip() / "state.json"
    if not state_file.is_file():
        return None
    return load_checkpoint(state_file.parent)


def load_optimizer(worker: PolicyWorker, ckpt: CheckpointState, prefix: str = "") -> None:
    """Restore the optimizer state and the learning-rate schedule's position saved by this rank
    (`prefix="critic_"`: the critic's); the learning rate is the schedule's at that position (the
    run's, over its own step count)."""
    state = torch.load(ckpt.path / f"{prefix}optimizer_rank{worker.rank}.pt", weights_only=False)
    if "optimizer" not in state:  # written before the schedule was saved with it
        state = {"optimizer": state, "lr_scheduler": None}
    worker.optimizer.load_state_dict(state["optimizer"])
    schedule = worker.lr_scheduler
    if state["lr_scheduler"] is not None and schedule is not None:
        schedule.load_state_dict(state["lr_scheduler"])
        # the saved rate is the old run's schedule's; a resumed run with more steps follows its own
        for group, base, factor in zip(worker.optimizer.param_groups, schedule.base_lrs,
                                       getattr(schedule, "lr_lambdas", ()), strict=False):
            group["lr"] = base * factor(schedule.last_epoch)
