"""Per-step metrics: a JSONL file, TensorBoard scalars, a console progress bar, and a PNG plot.

Every step's record holds `step`, `time` (seconds since training started) and flat numeric keys
(`reward`, `accuracy`, `staleness_mean`, `staleness_max`, `is_ratio_*`, `kv/*` engine counters,
`timing/*`, `throughput/*`, ...); `plot_metrics` turns the JSONL into a picture of reward and
staleness over time.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

PROGRESS_KEYS = (("reward", "reward {:.2f}"), ("accuracy", "acc {:.0%}"), ("staleness_mean", "stale {:.2f}"),
                 ("throughput/samples_per_s", "{:.0f} samples/s"))


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class MetricsLogger:
    """Writes each step's metrics to `<out_dir>/metrics.jsonl` (and TensorBoard under
    `<out_dir>/tensorboard`), and shows progress on `console`."""

    def __init__(
        self,
        out_dir: str | os.PathLike | Path,
        tensorboard: bool = True,
        progress: bool = True,
        total_steps: int | None = None,
        console: Console | None = None,
        log_interval: int = 10,
        append: bool = False,
    ) -> None:
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.out_dir / "metrics.jsonl"
        self._file = self.path.open("a" if append else "w")
        self.console = console or Console()
        self.log_interval = log_interval
        self.writer = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.writer = SummaryWriter(str(self.out_dir / "tensorboard"))
            except ImportError:  # tensorboard not installed: JSONL only
                self.console.print("[yellow]tensorboard is not installed; metrics go to JSONL only[/yellow]")
        self.progress: Progress | None = None
        self._task = None
        if progress and self.console.is_terminal:
            self.progress = Progress(
                TextColumn("[bold]RL"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.description}"),
                TimeElapsedColumn(), console=self.console, transient=False,
            )
            self._task = self.progress.add_task("", total=total_steps)
            self.progress.start()
        self.records: list[dict[str, Any]] = []

    def log(self, step: int, metrics: dict[str, Any]) -> dict[str, Any]:
        record = {"step": step, **{k: _clean(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        self.records.append(record)
        if self.writer is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, int | float) and not isinstance(value, bool):
                    self.writer.add_scalar(key, value, step)
        summary = "  ".join(fmt.format(record[k]) for k, fmt in PROGRESS_KEYS if isinstance(record.get(k), int | float))
        if self.progress is not None:
            self.progress.update(self._task, completed=step, description=summary)
        elif summary and (step % self.log_interval == 0 or step == 1):
            self.console.print(f"step {step}: {summary}", highlight=False)
        return record

    def print(self, text: str) -> None:
        self.console.print(text, highlight=False)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None
        if self.writer is not None:
            self.writer.flush()
            self.writer.close()
            self.writer = None
        if not self._file.closed:
            self._file.close()


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def plot_metrics(jsonl: str | Path, png: str | Path, title: str | None = None) -> Path:
    """Reward and accuracy (top) and staleness mean/max in weight versions (bottom) against
    training time, from a metrics JSONL; saved as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    everything = read_metrics(jsonl)
    records = [r for r in everything if "reward" in r]
    t = [r.get("time", r["step"]) for r in records]
    window = max(1, len(records) // 40)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    reward = [r["reward"] for r in records]
    top.plot(t, reward, color="tab:blue", alpha=0.25, linewidth=0.8)
    top.plot(t, _rolling(reward, window), color="tab:blue", label=f"reward of training samples (mean of {window})")
    accuracy = [r.get("accuracy") for r in records]
    if any(a is not None and a != rw for a, rw in zip(accuracy, reward, strict=True)):
        top.plot(t, _rolling([a or 0.0 for a in accuracy], window), color="tab:orange", label="sample accuracy")
    evals = [(r.get("time", r["step"]), r["eval/accuracy"]) for r in everything if r.get("eval/accuracy") is not None]
    if evals:
        top.plot(*zip(*evals, strict=True), "o-", color="tab:green", label="held-out greedy accuracy")
    top.set_ylabel("reward / accuracy")
    top.set_ylim(-0.02, 1.02)
    top.legend(loc="upper left")
    top.grid(alpha=0.3)
    bottom.plot(t, _rolling([r.get("staleness_mean") or 0.0 for r in records], window), label="staleness mean")
    bottom.plot(t, [r.get("staleness_max") or 0.0 for r in records], label="staleness max", alpha=0.6)
    bottom.set_ylabel("staleness (weight versions)")
    bottom.set_xlabel("training time (s)")
    bottom.legend(loc="lower right")
    bottom.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    png = Path(png)
    fig.savefig(png, dpi=100)
    plt.close(fig)
    return png


def _rolling(values: list[float], window: int) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


class StepTimer:
    """Wall-clock marks for one step's phases (`timing/<name>_s`)."""

    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.timings: dict[str, float] = {}

    def add(self, name: str, seconds: float) -> None:
        self.timings[f"timing/{name}_s"] = self.timings.get(f"timing/{name}_s", 0.0) + seconds
