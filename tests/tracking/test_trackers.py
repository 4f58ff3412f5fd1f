"""Experiment trackers get the JSONL's metric names, read back through each tracker's own tooling:
MLflow's client over a `file:` store, TensorBoard's event reader, W&B's offline run file."""

from __future__ import annotations

import time

import pytest

from inflight.testing import LOCAL_CPU
from inflight.tracking.metrics import MetricsLogger, read_metrics
from inflight.tracking.trackers import make_trackers, mlflow_metric_name, tracker_names

CONFIG = {"trainer": {"project_name": "proj", "policy": {"optimizer_config": {"lr": 1e-4}}}}
STEPS = {
    1: {"reward": 0.25, "kv/preemptions": 3, "eval/gsm8k/pass@1": 0.5, "note": "text", "flag": True},
    2: {"reward": 0.75, "kv/preemptions": 4, "nan": float("nan")},
}


def _run(tmp_path, logger: str):
    trackers = make_trackers(logger, tmp_path, project_name="proj", run_name="run-1", config=CONFIG)
    metrics = MetricsLogger(tmp_path, progress=False, trackers=trackers)
    for step, values in STEPS.items():
        metrics.log(step, values)
    metrics.close()
    return trackers


def test_tracker_names_accept_skyrl_forms():
    assert tracker_names("wandb") == ["wandb"]
    assert tracker_names("console,tensorboard") == ["console", "tensorboard"]
    assert tracker_names(["mlflow", "wandb"]) == ["mlflow", "wandb"]
    with pytest.raises(ValueError, match=r"unknown tracker\(s\) \['neptune'\]"):
        make_trackers("neptune", "/tmp/unused")


def test_mlflow_file_store_holds_every_numeric_metric(tmp_path, monkeypatch):
    mlflow = pytest.importorskip("mlflow")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    (tracker,) = _run(tmp_path, "mlflow")
    client = mlflow.tracking.MlflowClient(tracking_uri=(tmp_path / "mlruns").resolve().as_uri())
    run = client.get_run(tracker.run_id)
    assert run.info.run_name == "run-1"
    assert client.get_experiment(run.info.experiment_id).name == "proj"
    assert run.data.params["trainer.policy.optimizer_config.lr"] == "0.0001"
    history = {k: [(m.step, m.value) for m in client.get_metric_history(tracker.run_id, k)]
               for k in run.data.metrics}
    assert history == {
        "reward": [(1, 0.25), (2, 0.75)],
        "kv/preemptions": [(1, 3.0), (2, 4.0)],
        mlflow_metric_name("eval/gsm8k/pass@1"): [(1, 0.5)],
    }
    assert mlflow_metric_name("eval/gsm8k/pass@1") == "eval/gsm8k/pass_1"
    assert [a.path for a in client.list_artifacts(tracker.run_id)] == ["config.yaml"]


def test_tensorboard_event_file_holds_the_jsonl_names(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _run(tmp_path, "console,tensorboard")
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert sorted(events.Tags()["scalars"]) == sorted(["reward", "kv/preemptions", "eval/gsm8k/pass@1"])
    assert [(e.step, e.value) for e in events.Scalars("reward")] == [(1, 0.25), (2, 0.75)]
    jsonl_names = {k for r in read_metrics(tmp_path / "metrics.jsonl") for k in r} - {"step"}
    assert set(events.Tags()["scalars"]) <= jsonl_names


def test_wandb_offline_run_records_metrics_and_config(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    (tracker,) = _run(tmp_path, ["wandb"])
    (run_file,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    deadline = time.monotonic() + 30  # wandb's service process writes the file; lost data still fails
    while b"reward" not in (data := run_file.read_bytes()) and time.monotonic() < deadline:
        time.sleep(0.2)
    for key in ("reward", "kv/preemptions", "eval/gsm8k/pass@1", "optimizer_config"):
        assert key.encode() in data, key
    assert b"note" not in data and b'"nan"' not in data  # only numbers, never NaN


def test_missing_package_is_a_clear_error(tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_wandb(name, *args, **kwargs):
        if name == "wandb":
            raise ImportError("No module named 'wandb'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_wandb)
    with pytest.raises(RuntimeError, match=r"trainer.logger=wandb needs the wandb package: pip install"):
        make_trackers(["tensorboard", "wandb"], tmp_path)


def test_trainer_logger_takes_skyrl_spellings_and_refuses_unknown_names():
    from inflight.config import ConfigError, load_config

    assert load_config(None, list(LOCAL_CPU)).trainer.logger == ["console", "tensorboard"]
    assert load_config(None, [*LOCAL_CPU, "trainer.logger=wandb"]).trainer.logger == ["wandb"]
    assert load_config(None, [*LOCAL_CPU, "trainer.logger=console,mlflow"]).trainer.logger == [
        "console",
        "mlflow",
    ]
    assert load_config(None, [*LOCAL_CPU, "trainer.logger=[tensorboard,wandb]"]).trainer.logger == [
        "tensorboard",
        "wandb",
    ]
    with pytest.raises(ConfigError, match=r"trainer.logger=\['wandbb'\]: unknown tracker\(s\) \['wandbb'\]"):
        load_config(None, [*LOCAL_CPU, "trainer.logger=wandbb"])
