"""What a training run writes about itself: the resolved config (`<job.output_dir>/config.yaml`, also
sent to every tracker) and the metrics logger with the trackers `trainer.logger` names."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import yaml

from inflight.config import Config
from inflight.train.job_config import JobConfig
from inflight.train.metrics import MetricsLogger
from inflight.train.trackers import make_trackers


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
    names = [n for n in cfg.trainer.logger if n != "console" and (n != "tensorboard" or job.tensorboard)]
    trackers = make_trackers(names, out, project_name=cfg.trainer.project_name, run_name=cfg.trainer.run_name,
                             config=resolved, tags=cfg.trainer.tags)
    return MetricsLogger(out, progress=job.progress and "console" in cfg.trainer.logger,
                         total_steps=total_steps, log_interval=job.log_interval,
                         append=resume_step is not None, trackers=trackers, resume_step=resume_step)
