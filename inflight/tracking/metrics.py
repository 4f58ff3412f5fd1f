"""Per-step metrics: a JSONL file, the experiment trackers (TensorBoard, W&B, MLflow), a console
progress bar, and a PNG plot.

Every step's record holds `step`, `time` (seconds since training started) and flat numeric keys
(`reward`, `accuracy`, `staleness_mean`, `staleness_max`, `is_ratio_*`, `kv/*` engine counters,
`timing/*`, `throughput/*`, ...); `plot_metrics` turns the JSONL into a picture of reward and
staleness over time.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from inflight.tracking.trackers import Tracker, numeric

PROGRESS_KEYS = (("reward", "reward {:.2f}"), ("accuracy", "acc {:.0%}"), ("staleness_mean", "stale {:.2f}"),
                 ("throughput/samples_per_s", "{:.0f} samples/s"))


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class MetricsLogger:
    """Writes each step's metrics to `<out_dir>/metrics.jsonl`, sends the numbers to the
    experiment trackers (`trackers`), and shows progress on `console`.

    `append`: continue an existing file; with `resume_step` (the checkpoint a run resumes from),
    the rows of later steps, which the resumed run logs again, are dropped first."""

    def __init__(self, out_dir: str | os.PathLike | Path, progress: bool = True,
                 total_steps: int | None = None, console: Console | None = None, log_interval: int = 10,
                 append: bool = False, trackers: Sequence[Tracker] = (),
                 resume_step: int | None = None) -> None:
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.out_dir / "metrics.jsonl"
        if append and resume_step is not None:
            drop_after(self.path, resume_step)
        self._file = self.path.open("a" if append else "w")
        self.console = console or Console(soft_wrap=True)  # lines are not cut at 80 columns in a file
        self.log_interval = log_interval
        self.trackers: list[Tracker] = list(trackers)
        self.progress: Progress | None = None
        self._task = None
        if progress and self.console.is_terminal:
            self.progress = Progress(TextColumn("[bold]RL"), BarColumn(), MofNCompleteColumn(),
                                     TextColumn("{task.description}"), TimeElapsedColumn(),
                                     console=self.console, transient=False)
            self._task = self.progress.add_task("", total=total_steps)
            self.progress.start()

    def log(self, step: int, metrics: dict[str, Any]) -> dict[str, Any]:
        record = {"step": step, **{k: _clean(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        values = numeric({k: v for k, v in record.items() if k != "step"})
        for tracker in self.trackers:
            tracker.log(values, step)
        summary = "  ".join(
            fmt.format(record[k]) for k, fmt in PROGRESS_KEYS if isinstance(record.get(k), int | float)
        )
        if self.progress is not None:
            self.progress.update(self._task, completed=step, description=summary)
        elif summary and (step % self.log_interval == 0 or step == 1):
            self.console.print(f"step {step}: {summary}", highlight=False)
        return record

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None
        for tracker in self.trackers:
            tracker.close()
        if not self._file.closed:
            self._file.close()


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def drop_after(path: Path, step: int) -> None:
    """Rewrite the metrics JSONL at `path` without the rows of steps after `step` (atomically). A
    missing file is left missing."""
    if not path.is_file():
        return
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    kept = [line for line in lines if json.loads(line).get("step", 0) <= step]
    if len(kept) != len(lines):
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        os.replace(tmp, path)


def plot_metrics(jsonl: str | Path, png: str | Path, title: str | None = None) -> Path:
    """Against training time, from a metrics JSONL, saved as a PNG: reward, sample accuracy and the
    held-out evaluations' pass@1 (top; one line per data set when there are several), response
    length and truncated fraction (middle), staleness mean/max in weight versions (bottom)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    everything = read_metrics(jsonl)
    records = [r for r in everything if "reward" in r]
    t = [r.get("time", r["step"]) for r in records]
    window = max(1, len(records) // 40)
    fig, (top, middle, bottom) = plt.subplots(3, 1, figsize=(8, 8.5), sharex=True)
    _plot_reward(top, everything, records, t, window)
    _plot_lengths(middle, records, t, window)
    staleness = [r.get("staleness_mean") or 0.0 for r in records]
    bottom.plot(t, _rolling(staleness, window), label="staleness mean")
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


def _plot_reward(ax: Any, everything: list[dict], records: list[dict], t: list[float], window: int) -> None:
    reward = [r["reward"] for r in records]
    ax.plot(t, reward, color="tab:blue", alpha=0.25, linewidth=0.8)
    ax.plot(t, _rolling(reward, window), color="tab:blue",
            label=f"reward of training samples (mean of {window})")
    accuracy = [r.get("accuracy") for r in records]
    if any(a is not None and a != rw for a, rw in zip(accuracy, reward, strict=True)):
        ax.plot(
            t, _rolling([a or 0.0 for a in accuracy], window), color="tab:orange", label="sample accuracy"
        )
    for i, (key, label) in enumerate(_eval_series(everything)):
        points = [(r.get("time", r["step"]), r[key]) for r in everything if r.get(key) is not None]
        ax.plot(*zip(*points, strict=True), "o-", color=EVAL_COLORS[i % len(EVAL_COLORS)], label=label)
    ax.set_ylabel("reward / accuracy")
    ax.set_ylim(-0.02, 1.02)
    ax.legend(loc="upper left")
    ax.grid(alpha=0.3)


EVAL_COLORS = ("tab:green", "tab:red", "tab:brown", "tab:pink", "tab:olive", "tab:cyan")


def _eval_series(records: list[dict]) -> list[tuple[str, str]]:
    """(key, label) of the evaluation lines: pass@1 of each data set when there are several,
    else the overall `eval/accuracy`."""
    sets = sorted({k.split("/")[1] for r in records for k in r
                   if k.startswith("eval/") and k.endswith("/pass@1") and k.count("/") == 2})
    if len(sets) > 1:
        return [(f"eval/{name}/pass@1", f"held-out pass@1: {name}") for name in sets]
    if any("eval/accuracy" in r for r in records):
        return [("eval/accuracy", "held-out pass@1 (greedy: accuracy)")]
    return []


def _plot_lengths(ax: Any, records: list[dict], t: list[float], window: int) -> None:
    length = [r.get("response_length") or 0.0 for r in records]
    ax.plot(t, _rolling(length, window), color="tab:purple", label="response length (tokens)")
    ax.set_ylabel("response length (tokens)")
    ax.grid(alpha=0.3)
    right = ax.twinx()
    truncated = [r.get("truncated_fraction") or 0.0 for r in records]
    right.plot(t, _rolling(truncated, window), color="tab:red", alpha=0.7, label="truncated fraction")
    right.set_ylabel("truncated fraction")
    right.set_ylim(-0.02, 1.02)
    lines = ax.get_lines() + right.get_lines()
    ax.legend(lines, [line.get_label() for line in lines], loc="upper left")


def _rolling(values: list[float], window: int) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out

