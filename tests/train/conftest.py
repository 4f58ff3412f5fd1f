"""The train tests reuse the engine tests' weight helpers (models A/B, oracles) and share the
module-scoped fixtures `models` (tiny models A and B) and `worker_b` (a real single-process
policy worker holding model B)."""

from __future__ import annotations

import sys
from pathlib import Path

_ENGINE_TESTS = str(Path(__file__).resolve().parents[1] / "engine")
if _ENGINE_TESTS not in sys.path:
    sys.path.insert(0, _ENGINE_TESTS)


import pytest  # noqa: E402
from conftest_weights import tiny_models  # noqa: E402

from inflight.config import load_config  # noqa: E402
from inflight.testing import LOCAL_CPU  # noqa: E402
from inflight.train import LocalPolicyWorker  # noqa: E402


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return tiny_models(tmp_path_factory)


@pytest.fixture(scope="module")
def worker_b(models):
    """A real (single-process) policy worker whose weights are model B."""
    return LocalPolicyWorker(load_config(None, list(LOCAL_CPU)), model_path=str(models.dir_b)).setup()
