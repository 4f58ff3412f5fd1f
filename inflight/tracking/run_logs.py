"""What a training run writes about itself: the resolved config (`<job.output_dir>/config.yaml`, also
sent to every tracker) and the metrics logger with the trackers `trainer.logger` names."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import yaml

from inflight.config import Config
from inflight.config.job import JobConfig
from inflight.tracking.metrics import MetricsLogger
from inflight.tracking.trackers import make_trackers


def open_run_logs(cfg: Config, job: JobConfig, resume_step: int | None = None,
                  total_steps: int | None = None) -> MetricsLogger:
    """Save the resolved config under `job.output_dir` and open the run's metrics logger.
    `resume_step`: the checkpoint the run resumes from (its metrics file is continued from there);
    `total_steps`: the run's training steps (the progress bar's length).
    `job.tensorboard=false` / `job.progress=false` switch those off whatever `trainer.logger` says."""
    out = Path(job.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    resolved = {**dataclasses.asdict(cfg), "job": dataclasses.asdict(job)}  # the schema's and job's settings
    (out / "config.yaml").write_text(yaml.safe_dump(resolved, sort_keys=False))
    trackers = make_trackers(
        tracker_names(cfg, job),
        out,
        project_name=cfg.trainer.project_name,
        run_name=cfg.trainer.run_name,
        config=resolved,
        tags=cfg.trainer.tags,
    )
    return MetricsLogger(out, progress=job.progress and "console" in cfg.trainer.logger,
                         total_steps=total_steps, log_interval=job.log_interval,
                         append=resume_step is not None, trackers=trackers, resume_step=resume_step)


def tracker_names(cfg: Config, job: JobConfig) -> list[str]:
    """The trackers a run opens: `trainer.logger`'s but the console (the progress bar and the
    messages), without tensorboard when `job.tensorboard=false`."""
    return [n for n in cfg.trainer.logger if n != "console" and (n != "tensorboard" or job.tensorboard)]


def where_logged(cfg: Config, job: JobConfig, plot: str | None = None) -> str:
    """The run's last line: where its metrics went (metrics.jsonl; TensorBoard's folder only when it
    is on; the plot when one was drawn)."""
    out = Path(job.output_dir)
    parts = [f"metrics: {out / 'metrics.jsonl'}"]
    if "tensorboard" in tracker_names(cfg, job):
        parts.append(f"tensorboard: {out / 'tensorboard'}")
    if plot:
        parts.append(f"plot: {plot}")
    return "  ".join(parts)
