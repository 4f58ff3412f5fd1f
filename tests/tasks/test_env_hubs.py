"""The environment hubs (ours, skyrl-gym, verifiers, OpenEnv) behind one registry and one lookup
(`inflight.rewards.hubs.find_hub`): each hub's names resolve through it, the data task builds what
its entry names, and a name no hub holds is refused listing every hub, at validation and at load."""

from __future__ import annotations

import dataclasses
import json

import pytest
import skyrl_gym

from inflight.agents.run import uses_agent
from inflight.agents.verifiers_env import ENV_VAR, VerifiersAgent
from inflight.config import load_config
from inflight.config.implemented import unimplemented
from inflight.config.validate import env_class_problem
from inflight.import_path import import_object
from inflight.rewards import RewardError
from inflight.rewards.hubs import HUBS, UnknownEnvironment, agent_hub, find_hub, hub_problem
from inflight.rewards.registry import SKYRL_GYM_ENVIRONMENTS
from inflight.tasks import DataTask, make_char_tokenizer
from inflight.tasks.openenv_env import OpenEnvEnvironment
from inflight.tasks.skyrl_gym_env import GymEnvironmentMaker
from inflight.tasks.tool_env import ToolEnv
from inflight.testing import LOCAL_CPU

TOK = make_char_tokenizer("0123456789+=? abcdefghijklmnopqrstuvwxyz")
NAMES = {
    "ours": ("gsm8k", "tool", "my_rewards:score", "skyrl_gym:"),  # an empty id is an import, refused on load
    "skyrl-gym": ("aime", "text2sql", "skyrl_gym:anything"),
    "verifiers": ("verifiers:wordle",),
    "openenv": ("openenv",),
}


def _rows(tmp_path, n=3):
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"q{i}", "answer": str(i)}) + "\n" for i in range(n)))
    return path


def test_every_hub_resolves_through_the_one_lookup():
    assert [hub.name for hub in HUBS] == ["verifiers", "openenv", "skyrl-gym", "ours"]
    for hub_name, names in NAMES.items():
        for name in names:
            assert find_hub(name).name == hub_name, name
    for hub in HUBS:  # what each entry names by path is there, and builds or plays, not both
        assert (hub.make is None) != (hub.agent is None), hub.name
        assert callable(import_object(hub.make or hub.agent, "test", RewardError))
        assert hub.check is None or callable(import_object(hub.check, "test", RewardError))
    assert import_object(find_hub("verifiers:x").agent, "test", RewardError) is VerifiersAgent
    assert {hub.turns for hub in HUBS} <= {"single", "multi", "single or multi"}


def test_the_skyrl_gym_hubs_bare_names_are_skyrl_gyms_own():
    """skyrl-gym's own registry (the installed package) holds every id the hub lists; ours keep `gsm8k`."""
    listed = find_hub("aime").names()
    assert set(SKYRL_GYM_ENVIRONMENTS) <= set(skyrl_gym.registry) | {"gsm8k"}
    assert "gsm8k" not in listed and set(listed) - {"multiply", "llm_as_a_judge"} <= set(skyrl_gym.registry)


def test_the_data_task_builds_what_each_hub_makes(tmp_path):
    rows = _rows(tmp_path)
    task = DataTask(TOK, [rows], env_class="skyrl_gym:gsm8k")
    assert isinstance(task.reward_fn(task.train_problems()[0]), GymEnvironmentMaker)
    task = DataTask(TOK, [rows], env_class="openenv")
    assert issubclass(task.reward_fn(task.train_problems()[0]), OpenEnvEnvironment)
    task = DataTask(TOK, [rows], env_class="tool")
    assert task.reward_fn(task.train_problems()[0]) is ToolEnv
    task = DataTask(TOK, [rows], env_class="verifiers:tiny")  # its agent plays: nothing resolved here
    with pytest.raises(RewardError, match="'verifiers:tiny' is a verifiers environment: its agent plays"):
        task.reward_fn(task.train_problems()[0])


def test_the_agent_run_asks_the_lookup():
    cfg = load_config(None, [*LOCAL_CPU, "environment.env_class=verifiers:wordle"])
    hub, env_id = agent_hub(cfg.environment.env_class)
    assert (hub.name, env_id, hub.section) == ("verifiers", "wordle", "verifiers") and uses_agent(cfg)
    assert agent_hub("aime") is None and agent_hub("nope") is None and agent_hub(None) is None


def test_an_unknown_name_lists_the_hubs(tmp_path):
    with pytest.raises(UnknownEnvironment) as err:
        find_hub("text2sq")
    message = str(err.value)
    assert message.startswith("environment.env_class='text2sq' is not a known reward or environment")
    assert "did you mean 'text2sql'?" in message
    for part in ("verifiers (verifiers:<env id>)", "openenv (openenv)", "skyrl-gym (aime, ",
                 "skyrl_gym:<id>)",
                 "ours (gsm8k, ", "tool, ", "package.module:name)"):
        assert part in message, part
    problem = env_class_problem("text2sq")
    assert (problem.key, problem.fix) == ("environment.env_class", err.value.fix)
    cfg = load_config(None, [*LOCAL_CPU, "environment.env_class=text2sq"])
    assert [v.fix for v in unimplemented(cfg) if v.key == "environment.env_class"] == [err.value.fix]
    with pytest.raises(RewardError, match=r"environment.env_class='text2sq' .*environment hubs: verifiers"):
        DataTask(TOK, [_rows(tmp_path)], env_class="text2sq")


def test_what_a_hub_needs_installed_is_a_refusal_with_its_install_hint(monkeypatch, tmp_path):
    cfg = load_config(None, [*LOCAL_CPU, "environment.env_class=aime"])
    assert hub_problem(cfg) is None  # skyrl-gym is installed here
    missing = dataclasses.replace(find_hub("aime"), requires="inflight_no_such_module")
    assert missing.missing(cfg) == (
        "environment.env_class names a skyrl-gym environment, and inflight_no_such_module is not installed: "
        "pip install 'inflight[environments]' (or skyrl-gym==0.4.0)")
    monkeypatch.setenv(ENV_VAR, str(tmp_path / "no-python"))
    cfg = load_config(None, [*LOCAL_CPU, "environment.env_class=verifiers:wordle"])
    assert "scripts/verifiers_venv.sh" in hub_problem(cfg)
