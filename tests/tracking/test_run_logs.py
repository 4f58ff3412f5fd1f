"""A run saves its resolved config (loadable again) and opens the trackers `trainer.logger` names."""

from __future__ import annotations

import pytest
import yaml

from inflight.config import config_from_dict, load_config
from inflight.config.job import JobConfig
from inflight.testing import LOCAL_CPU
from inflight.tracking.run_logs import open_run_logs


def test_the_resolved_config_is_saved_and_reloads_to_the_same_config(tmp_path):
    cfg = load_config(None, [*LOCAL_CPU, "trainer.logger=console", "trainer.policy.optimizer_config.lr=3e-5"])
    job = JobConfig(output_dir=str(tmp_path), progress=False)
    logger = open_run_logs(cfg, job)
    logger.log(1, {"reward": 0.5})
    logger.close()
    saved = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert saved["job"]["output_dir"] == str(tmp_path)
    assert config_from_dict({k: v for k, v in saved.items() if k != "job"}) == cfg
    assert logger.trackers == []  # console is the progress bar; tensorboard was not asked for


def test_trackers_follow_trainer_logger_and_job_switches(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    cfg = load_config(None, [*LOCAL_CPU, "trainer.logger=tensorboard,mlflow", "trainer.project_name=proj",
                             "trainer.run_name=first"])
    logger = open_run_logs(cfg, JobConfig(output_dir=str(tmp_path / "a"), progress=False))
    assert [t.name for t in logger.trackers] == ["tensorboard", "mlflow"] and logger.progress is None
    logger.close()
    quiet = open_run_logs(cfg, JobConfig(output_dir=str(tmp_path / "b"), tensorboard=False, progress=False))
    assert [t.name for t in quiet.trackers] == ["mlflow"]
    quiet.close()
