"""A mixture-of-experts rollout keeps the engine's routing record with its trajectory, through every
client: in process, the process pipe, Ray's actor calls (their pickled answers) and the HTTP token
route. Multi-turn episodes keep the last turn's record, which covers every position of the
trajectory but the last; checked against transformers' routers over the whole trajectory."""

from __future__ import annotations

import asyncio
import pickle
from collections.abc import Sequence

import numpy as np
import pytest
import torch
from moe_routing import hf_routing
from transformers import AutoModelForCausalLM, AutoTokenizer

from inflight.client import LocalClient, RemoteClient
from inflight.client.ops import apply_op
from inflight.client.process import EngineProcess, RayEngineClient
from inflight.engine import AsyncEngine, EngineConfig, LLMEngine
from inflight.rollout.task_generator import TaskGenerator
from inflight.server.launch import serve_model
from inflight.tasks.base import Environment, Problem, StepResult, Task
from inflight.testing import make_tiny_model


class TwoTurns(Environment):
    """A user message after the first turn, done after the second."""

    max_turns = 2

    def __init__(self, problem: Problem) -> None:
        self.problem, self.turns = problem, 0

    def reset(self):
        return self.problem.prompt

    def step(self, response: str) -> StepResult:
        self.turns += 1
        return StepResult([{"role": "user", "content": "and then?"}], 0.5, self.turns >= 2)


class ChatTask(Task):
    def __init__(self, tokenizer) -> None:
        super().__init__(tokenizer)
        self.problems = [
            Problem(f"p{i}", [{"role": "user", "content": f"count to {i}"}], "") for i in range(2)
        ]

    def train_problems(self) -> Sequence[Problem]:
        return self.problems

    def eval_problems(self) -> Sequence[Problem]:
        return self.problems

    def reward(self, problem: Problem, response: str) -> float:
        return 0.0

    def make_env(self, problem: Problem) -> Environment:
        return TwoTurns(problem)

    def encode_prompt(self, prompt) -> list[int]:
        return self.encode_chat(prompt)

    @property
    def stop_token_ids(self) -> list[int]:
        """A third of the vocabulary ends a turn: a random model's turns then end after a few tokens."""
        return [self.tokenizer.eos_token_id, *range(3, len(self.tokenizer), 3)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("moe"), "qwen3_moe", seed=2)


async def _play(client, task) -> list:
    gen = TaskGenerator(client, task, n=2, seed=3, max_tokens=6, return_routed_experts=True)
    return [t for p in task.train_problems() for t in (await gen(p)).trajectories]


class PickledActor:
    """What an engine actor's handle gives RayEngineClient: `call.remote(op, *args)` runs `apply_op`
    on the actor's engine and hands back the result as Ray does, serialised."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.call = self
        self.engine = engine

    async def remote(self, op: str, *args):
        return pickle.loads(pickle.dumps(await apply_op(self.engine, op, *pickle.loads(pickle.dumps(args)))))




def test_every_client_carries_the_record_into_the_trajectory(model_dir):
    task = ChatTask(AutoTokenizer.from_pretrained(model_dir))
    config = EngineConfig(model=str(model_dir), num_kv_blocks=128, block_size=4)

    async def in_process(make_client):
        engine = AsyncEngine(LLMEngine(config))
        try:
            return await _play(make_client(engine), task)
        finally:
            await engine.close()

    results = {"in process": asyncio.run(in_process(LocalClient)),
               "ray": asyncio.run(in_process(lambda e: RayEngineClient(PickledActor(e))))}
    with EngineProcess(config, 1) as proc:
        results["process pipe"] = asyncio.run(_play(proc.client, task))
    server = serve_model(config, "tiny-moe")
    try:
        async def remote():
            async with RemoteClient(server.url, retries=0) as client:
                return await _play(client, task)

        results["http"] = asyncio.run(remote())
    finally:
        server.stop()
    want = results["in process"]
    assert any(t.num_turns == 2 for t in want)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for t in want:
        full = t.prompt_ids + t.response_ids
        assert t.routed_experts_start == 0 and t.routed_experts.dtype == np.uint8
        assert len(t.routed_experts) == len(full) - 1  # the last turn's covers every earlier turn
        np.testing.assert_array_equal(t.routed_experts, hf_routing(hf, full[:-1]))
    for name, trajs in results.items():
        for got, t in zip(trajs, want, strict=True):
            assert got.response_ids == t.response_ids, name
            np.testing.assert_array_equal(got.routed_experts, t.routed_experts, err_msg=name)
