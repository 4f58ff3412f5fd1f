"""Metrics: JSONL records, TensorBoard event files, the PNG plot."""

from __future__ import annotations

import json

from inflight.tracking.metrics import MetricsLogger, plot_metrics, read_metrics
from inflight.tracking.trackers import TensorBoardTracker


def test_jsonl_tensorboard_and_plot(tmp_path):
    logger = MetricsLogger(tmp_path, progress=True, total_steps=3, log_interval=1,
                           trackers=[TensorBoardTracker(tmp_path, {})])
    logger.log(0, {"time": 0.0, "eval/accuracy": 0.25})
    for step in (1, 2, 3):
        logger.log(step, {"time": step * 0.5, "reward": 0.1 * step, "accuracy": 0.1 * step,
                          "staleness_mean": 0.5, "staleness_max": 1.0, "is_ratio_mean": None,
                          "timing/train_s": 0.2, "nan": float("nan")})
    logger.close()
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2, 3] and records[1]["nan"] is None
    assert json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[2])["reward"] == 0.2
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    png = plot_metrics(tmp_path / "metrics.jsonl", tmp_path / "plot.png", "test")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_resumed_run_does_not_repeat_the_steps_after_its_checkpoint(tmp_path):
    """A run killed at step 5 with its checkpoint at step 3 logs steps 4 and 5 again on resume."""
    first = MetricsLogger(tmp_path, progress=False)
    for step in range(1, 6):
        first.log(step, {"reward": step / 10})
    first.close()
    resumed = MetricsLogger(tmp_path, progress=False, append=True, resume_step=3)
    for step in (4, 5, 6):
        resumed.log(step, {"reward": step})
    resumed.close()
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert [r["reward"] for r in records] == [0.1, 0.2, 0.3, 4, 5, 6]
