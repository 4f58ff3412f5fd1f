"""The agent tests' model: `agent_model.make_agent_model`'s checkpoint, one per test module."""

from __future__ import annotations

import pytest
from agent_model import make_agent_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("agent_model")
    make_agent_model(path)
    return path
