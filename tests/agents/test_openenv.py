"""`environment.env_class=openenv`: an OpenEnv server started here with openenv-core's own server tools
(a small guessing environment, on a free port) plays the episodes of a training run through
openenv-core's client: reset per episode, one step per model turn, its reward and observations."""

from __future__ import annotations

import asyncio
import json

import pytest
from openenv.core.env_server.http_server import create_fastapi_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State

from inflight.config import load_config
from inflight.server.launch import BackgroundServer
from inflight.tasks.base import Problem
from inflight.tasks.openenv_env import (
    OpenEnvError,
    OpenEnvSettings,
    action_field_of,
    action_text,
    observation_text,
    openenv_environment,
)
from inflight.testing import LOCAL_CPU
from inflight.train.main import main

SEEN: list[str] = []  # every guess the server received


class GuessAction(Action):
    guess: str


class GuessObservation(Observation):
    feedback: str = ""


class GuessCity(Environment):
    """Guess the city in two tries: reward 1 for a guess that names Paris."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        self._state = State(episode_id="e", step_count=0)

    def reset(self, seed=None, episode_id=None, **kwargs) -> GuessObservation:
        self._state = State(episode_id=episode_id or "e", step_count=0)
        return GuessObservation(feedback="guess a city", done=False, reward=0.0)

    def step(self, action: GuessAction, timeout_s=None, **kwargs) -> GuessObservation:  # type: ignore[override]
        self._state.step_count += 1
        SEEN.append(action.guess)
        right = "Paris" in action.guess
        return GuessObservation(feedback="right" if right else f"not {action.guess[:10]!r}",
                                done=right or self._state.step_count >= 2, reward=float(right))

    @property
    def state(self) -> State:
        return self._state


@pytest.fixture(scope="module")
def server():
    app = create_fastapi_app(GuessCity, GuessAction, GuessObservation, max_concurrent_envs=32)
    with BackgroundServer(app) as srv:
        yield srv


def test_actions_and_observations_as_text():
    assert action_text("I think <action>Rome</action> no, <action> Paris </action>!") == "Paris"
    assert action_text("  Paris\n") == "Paris"
    assert observation_text({"feedback": "right", "metadata": {}, "done": True, "reward": 1.0}) == "right"
    assert observation_text({"a": 1, "b": "x"}) == "a: 1\nb: x"
    schema = {
        "properties": {"guess": {"type": "string"}, "n": {"type": "integer"}},
        "required": ["guess", "n"],
    }
    assert action_field_of(schema) == "guess"
    with pytest.raises(OpenEnvError, match="action_field"):
        action_field_of(
            {"properties": {"a": {"type": "string"}, "b": {"type": "string"}}, "required": ["a", "b"]}
        )
    with pytest.raises(OpenEnvError, match="both set"):
        openenv_environment(OpenEnvSettings(url="http://x", image="y"))


def test_an_episode_resets_steps_and_closes_its_session(server):
    env_class = openenv_environment(OpenEnvSettings(url=server.url))
    SEEN.clear()

    async def episode():
        env = env_class(Problem("p", "Which city?", "Paris"))
        prompt = await env.reset()
        first = await env.step("Maybe <action>Rome</action>")
        second = await env.step("<action>Paris</action>")
        await env.close()
        return prompt, first, second

    prompt, first, second = asyncio.run(episode())
    assert prompt == "Which city?" and SEEN == ["Rome", "Paris"]  # the field came from the server's schema
    assert (
        first.observation == {"role": "user", "content": "not 'Rome'"}
        and not first.done
        and first.reward == 0
    )
    assert second.done and second.reward == 1.0 and second.info["openenv_reset"] == "guess a city"


def test_a_run_trains_on_an_openenv_server(server, tiny_model_factory, tmp_path):
    data = tmp_path / "cities.jsonl"
    data.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"Name a city ({i})."}],
                                        "answer": "Paris"}) + "\n" for i in range(8)))
    SEEN.clear()
    argv = [
        *LOCAL_CPU,
        f"trainer.policy.model.path={tiny_model_factory('qwen2')}",
        f"data.train_data=['{data}']",
        "environment.env_class=openenv",
        f"environment.openenv.url={server.url}",
        "generator.max_turns=2",
        "trainer.fully_async.enabled=false",
        "trainer.train_batch_size=2",
        "trainer.policy_mini_batch_size=2",
        "generator.n_samples_per_prompt=2",
        "trainer.max_training_steps=2",
        "trainer.eval_interval=-1",
        "generator.sampling_params.max_generate_length=8",
        "trainer.logger=[console]",
        "generator.inference_engine.weight_sync_backend=inprocess",
        f"job.output_dir={tmp_path}",
        "job.plot=false",
    ]
    assert main(argv) == 0
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len([m for m in metrics if "samples" in m]) == 2
    assert len(SEEN) >= 2 * 2 * 2  # every episode stepped the server at least once
    assert load_config(None, [*LOCAL_CPU, "environment.env_class=openenv"]).environment.openenv.url is None
