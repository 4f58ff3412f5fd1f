"""Experiment trackers (`trainer.logger`, SkyRL's key): TensorBoard, Weights & Biases, MLflow.

Every tracker receives the same records the metrics JSONL holds (flat keys such as `reward`,
`kv/preemptions`, `eval/gsm8k/pass@1`) under the same names; only numbers are sent. MLflow refuses
some characters in metric names (it allows letters, digits, `_ - . / :` and spaces), so there
each other character becomes `_` (`eval/gsm8k/pass@1` -> `eval/gsm8k/pass_1`). The resolved
config goes to each tracker once, at the start (W&B run config, MLflow params plus a
`config.yaml` artifact, TensorBoard text). `console` is the progress bar of `MetricsLogger`.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from inflight.config.validate import TRACKERS

log = logging.getLogger(__name__)

_EXTRA_HINT = "pip install torch==2.13.0 {pkg}   (or: pip install torch==2.13.0 -e '.[trackers]')"


class TrackerUnavailable(RuntimeError):
    """A tracker named in `trainer.logger` whose package is not installed."""


class Tracker(Protocol):
    """Where a run's metrics go besides the JSONL file."""

    name: str

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        """Record one step's numeric metrics."""
        ...

    def close(self) -> None:
        """Flush and release (idempotent)."""
        ...


def tracker_names(logger: str | Sequence[str]) -> list[str]:
    """`trainer.logger` as a list of names: one name, a comma-separated string, or a list."""
    items = logger.split(",") if isinstance(logger, str) else list(logger)
    return [str(item).strip() for item in items if str(item).strip()]


def numeric(metrics: Mapping[str, Any]) -> dict[str, float]:
    """The entries a tracker can plot: finite-or-not ints and floats, never bools or None."""
    return {k: float(v) for k, v in metrics.items() if isinstance(v, int | float) and not isinstance(v, bool)}


def flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested config as dotted keys (`trainer.policy.optimizer_config.lr`)."""
    flat: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(flatten(value, f"{name}."))
        else:
            flat[name] = value
    return flat


class TensorBoardTracker:
    """Scalars under `<out_dir>/tensorboard`, the config as one text entry."""

    name = "tensorboard"

    def __init__(self, out_dir: Path, config: Mapping[str, Any]) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer: Any = SummaryWriter(str(out_dir / "tensorboard"))
        if config:
            import yaml

            self.writer.add_text("config", "```\n" + yaml.safe_dump(dict(config), sort_keys=False) + "```")

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.flush()
            self.writer.close()
            self.writer = None


def wandb_mode() -> str | None:
    """`offline` when neither `WANDB_API_KEY` nor `WANDB_MODE` is set (no login to wait for: the run
    is written under the output directory for `wandb sync`), else None (wandb decides)."""
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_MODE"):
        return None
    return "offline"


class WandbTracker:
    """A Weights & Biases run (`project_name`, `run_name`, `tags`); offline when no API key is set."""

    name = "wandb"

    def __init__(self, out_dir: Path, project: str, run_name: str, config: Mapping[str, Any],
                 tags: Sequence[str] | None = None) -> None:
        try:
            import wandb
        except ImportError as err:
            raise TrackerUnavailable("trainer.logger=wandb needs the wandb package: "
                                     + _EXTRA_HINT.format(pkg="wandb")) from err
        mode = wandb_mode()
        if mode == "offline":
            log.warning("wandb: no WANDB_API_KEY, so the run is logged offline under %s (upload it with "
                        "`wandb sync`)", out_dir / "wandb")
        self.run: Any = wandb.init(project=project, name=run_name, dir=str(out_dir), config=dict(config),
                                   reinit="finish_previous", tags=list(tags) if tags else None, mode=mode)

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        self.run.log(dict(metrics), step=step)

    def close(self) -> None:
        """Finish the run, then wait for wandb's service process to write (offline) or upload all of
        it: `finish` alone returned once before the offline run file held more than its header."""
        if self.run is not None:
            import wandb

            self.run.finish()
            self.run = None
            wandb.teardown()


_MLFLOW_BAD = re.compile(r"[^\w\-./: ]")
_MLFLOW_PARAM_CHARS = 6000  # MLflow's limit on one parameter value


def mlflow_metric_name(key: str) -> str:
    """`key` with the characters MLflow refuses in metric names replaced by `_`."""
    return _MLFLOW_BAD.sub("_", key)


class MlflowTracker:
    """An MLflow run in experiment `project_name`. Tracking URI: `MLFLOW_TRACKING_URI` when set,
    else a file store under `<out_dir>/mlruns` (no server needed)."""

    name = "mlflow"

    def __init__(self, out_dir: Path, project: str, run_name: str, config: Mapping[str, Any],
                 tags: Sequence[str] | None = None) -> None:
        try:
            import mlflow
        except ImportError as err:
            raise TrackerUnavailable("trainer.logger=mlflow needs the mlflow package: "
                                     + _EXTRA_HINT.format(pkg="mlflow-skinny")) from err
        if not os.environ.get("MLFLOW_TRACKING_URI"):
            # the local file store is what a run directory can hold; MLflow 3 asks for an opt-in
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            mlflow.set_tracking_uri((out_dir / "mlruns").resolve().as_uri())
        self.mlflow: Any = mlflow
        mlflow.set_experiment(project)
        self.run: Any = mlflow.start_run(run_name=run_name, tags={tag: "true" for tag in tags or ()})
        self.run_id: str = self.run.info.run_id
        params = [(k, str(v)[:_MLFLOW_PARAM_CHARS]) for k, v in flatten(config).items()]
        for start in range(0, len(params), 100):  # at most 100 params per call
            mlflow.log_params(dict(params[start:start + 100]))
        if config:
            mlflow.log_dict(dict(config), "config.yaml")

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        self.mlflow.log_metrics({mlflow_metric_name(k): v for k, v in metrics.items()}, step=step)

    def close(self) -> None:
        if self.run is not None:
            self.mlflow.end_run()
            self.run = None


def make_trackers(
    logger: str | Sequence[str],
    out_dir: str | os.PathLike,
    *,
    project_name: str = "inflight",
    run_name: str | None = None,
    config: Mapping[str, Any] | None = None,
    tags: Sequence[str] | None = None,
) -> list[Tracker]:
    """The trackers `trainer.logger` names (`console` is the progress bar: no tracker object).
    Raises ValueError for an unknown name and TrackerUnavailable when a package is missing; a
    tracker that was already started is closed before the error propagates. `tags`: the run's
    (`trainer.tags`; W&B and MLflow)."""
    names = tracker_names(logger)
    unknown = [name for name in names if name not in TRACKERS]
    if unknown:
        raise ValueError(f"trainer.logger: unknown tracker(s) {unknown}; use any of {list(TRACKERS)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    name = run_name or out.name
    config = dict(config or {})
    trackers: list[Tracker] = []
    try:
        for tracker in dict.fromkeys(names):
            if tracker == "tensorboard":
                trackers.append(TensorBoardTracker(out, config))
            elif tracker == "wandb":
                trackers.append(WandbTracker(out, project_name, name, config, tags))
            elif tracker == "mlflow":
                trackers.append(MlflowTracker(out, project_name, name, config, tags))
    except BaseException:
        for started in trackers:
            started.close()
        raise
    return trackers
