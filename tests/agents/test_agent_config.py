"""The agent keys, loading an agent by name, what an agent may return, and the
README's example (examples/agent) on a tiny model."""

from __future__ import annotations

import asyncio
import importlib.util
import json
from pathlib import Path

import pytest

from inflight.agents.agent import AgentError, load_agent, parse_result, run_agent
from inflight.config import ConfigError, load_config
from inflight.testing import LOCAL_CPU

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "agent" / "train_agent.py"


def test_the_agent_keys_are_checked():
    cfg = load_config(None, [*LOCAL_CPU, "generator.agent.path=mod:agent", "generator.agent.timeout_s=30"])
    assert cfg.generator.agent.path == "mod:agent" and cfg.generator.agent.port == 0
    with pytest.raises(ConfigError) as err:
        load_config(None, [*LOCAL_CPU, "generator.agent.port=70000", "generator.agent.timeout_s=0",
                           "generator.agent.host= "])
    assert sorted(err.value.keys) == [
        "generator.agent.host",
        "generator.agent.port",
        "generator.agent.timeout_s",
    ]


def async_agent(base_url, api_key, problem):
    return 1


class ClassAgent:
    async def __call__(self, base_url, api_key, problem):
        return 0.5, {"seen": problem}


def test_agents_load_by_name_and_answer_rewards():
    assert load_agent(f"{__name__}:async_agent") is async_agent
    instance = load_agent(f"{__name__}:ClassAgent")
    assert asyncio.run(run_agent(instance, "u", "k", "p")) == (0.5, {"seen": "p"})
    assert asyncio.run(run_agent(async_agent, "u", "k", "p")) == 1  # a plain function: in a thread
    for bad, message in [("nomodule_xyz:agent", "cannot import"), (f"{__name__}:missing", "has no attribute"),
                         ("no_colon", "package.module:name"), (f"{__name__}:EXAMPLE", "is a PosixPath")]:
        with pytest.raises(AgentError, match=message):
            load_agent(bad)
    assert parse_result(1) == (1.0, {}) and parse_result((0.25, {"a": 1})) == (0.25, {"a": 1})
    for bad in ["1.0", (1.0, 2.0), None, float("nan")]:
        with pytest.raises(AgentError):
            parse_result(bad)


def test_the_readmes_agent_example_trains_a_tiny_model(tmp_path):
    spec = importlib.util.spec_from_file_location("train_agent", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    assert example.main(["--tiny", "--output", str(tmp_path)]) == 0
    steps = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in steps if "agent/calls_per_episode" in m] == [1, 2]
