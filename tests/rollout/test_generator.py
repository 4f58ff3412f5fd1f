"""The generator against a real engine: per-token ids, rollout logprobs (checked against
transformers through the training batch), weight versions, multi-turn loss masks, seeds."""

from __future__ import annotations

import asyncio

import pytest
import torch
from rl_support import small_task, warm_model_dir
from transformers import AutoModelForCausalLM

from inflight.client import LocalClient
from inflight.engine import AsyncEngine, EngineConfig, LLMEngine
from inflight.rollout.task_generator import ENV_VERSION, TaskGenerator, generate_groups, request_seed
from inflight.tasks import ChainAdditionTask
from inflight.train.losses import token_logprobs
from inflight.train.step import build_batch


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return warm_model_dir(tmp_path_factory)


def _run(model_dir, body, version: int = 0):
    async def main():
        engine = AsyncEngine(LLMEngine(EngineConfig(model=str(model_dir), num_kv_blocks=64, max_num_seqs=64,
                                                    weight_version=version)))
        try:
            return await body(LocalClient(engine))
        finally:
            await engine.close()

    return asyncio.run(main())


def test_single_turn_group_keeps_tokens_logprobs_versions(model_dir):
    task = small_task()
    problems = task.train_problems()[:3]

    async def body(client):
        gen = TaskGenerator(client, task, n=4, temperature=1.0, seed=7)
        return await generate_groups(gen, problems)

    groups = _run(model_dir, body, version=3)
    assert [g.prompt_id for g in groups] == [p.id for p in problems]
    for g, p in zip(groups, problems, strict=True):
        assert len(g.trajectories) == 4
        for t in g.trajectories:
            n = len(t.response_ids)
            assert n >= 1 and len(t.logprobs) == len(t.versions) == len(t.loss_mask) == n
            assert t.loss_mask == [1] * n and set(t.versions) == {3} and t.num_turns == 1
            assert t.prompt_ids == task.encode_prompt(p.prompt)
            text = task.decode(t.response_ids)
            assert t.reward == task.reward(p, text)
            if t.finish_reason == "stop":
                assert t.response_ids[-1] == task.tokenizer.eos_token_id
    # the rollout logprobs sit where the training batch expects them: recompute with transformers
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    batch = build_batch(groups, torch.zeros(12), pad_id=0)
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    recomputed = token_logprobs(logits, batch.input_ids, 1.0)
    mask = batch.loss_mask > 0
    torch.testing.assert_close(recomputed[mask], batch.rollout_logprobs[mask], atol=2e-4, rtol=1e-4)
    assert (batch.versions[mask] == 3).all() and (batch.versions[~mask] == -1).all()


def test_seeded_samples_are_reproducible(model_dir):
    task = small_task()
    problem = task.train_problems()[0]

    async def body(client):
        gen = TaskGenerator(client, task, n=6, temperature=1.0, seed=11)
        return await gen(problem), await gen(problem), await gen(problem, epoch=1)

    first, second, other_epoch = _run(model_dir, body)
    assert [t.response_ids for t in first.trajectories] == [t.response_ids for t in second.trajectories]
    assert request_seed(11, 0, problem.id, 0) != request_seed(11, 1, problem.id, 0)
    assert len(other_epoch.trajectories) == 6


def test_multi_turn_masks_environment_tokens(model_dir):
    task = ChainAdditionTask(max_digits=1, num_eval=20, num_train=50, turns=3)

    async def body(client):
        gen = TaskGenerator(client, task, n=8, temperature=1.0, seed=3, max_context=32)
        return await generate_groups(gen, task.train_problems()[:6])

    groups = _run(model_dir, body)
    multi = [t for g in groups for t in g.trajectories if t.num_turns > 1]
    assert multi, "no episode got past the first turn"
    for t in multi:
        env_positions = [i for i, m in enumerate(t.loss_mask) if m == 0]
        assert env_positions
        for i in env_positions:
            assert t.versions[i] == ENV_VERSION and t.logprobs[i] == 0.0
        # every observation is "+c=" and follows the model's EOS
        text = task.tokenizer.decode(t.response_ids)
        assert text.count("<eos>") >= t.num_turns - 1 and "+" in text
        assert 0 < t.reward <= 1.0
    batch = build_batch(groups, torch.zeros(sum(len(g.trajectories) for g in groups)), pad_id=0)
    assert int(batch.loss_mask.sum()) == sum(t.num_generated for g in groups for t in g.trajectories)


class RecordingClient(LocalClient):
    """A LocalClient that records the session of each request it serves."""

    def __init__(self, engine) -> None:
        super().__init__(engine)
        self.sessions: list[str | None] = []

    async def generate(self, prompt_token_ids, params=None, **kwargs):
        self.sessions.append(kwargs.get("session_id"))
        return await super().generate(prompt_token_ids, params, **kwargs)


def test_every_turn_of_an_episode_goes_to_one_engine(model_dir):
    from inflight.client.fanout import FanOutClient

    task = ChainAdditionTask(max_digits=1, num_eval=20, num_train=50, turns=3)

    async def main():
        engines = [AsyncEngine(LLMEngine(EngineConfig(model=str(model_dir), num_kv_blocks=64, seed=i)))
                   for i in range(2)]
        clients = [RecordingClient(e) for e in engines]
        try:
            gen = TaskGenerator(FanOutClient(clients), task, n=8, temperature=1.0, seed=3, max_context=32)
            groups = await generate_groups(gen, task.train_problems()[:4])
        finally:
            await asyncio.gather(*(e.close() for e in engines))
        return groups, [c.sessions for c in clients]

    groups, sessions = asyncio.run(main())
    turns = sum(t.num_turns for g in groups for t in g.trajectories)
    assert sum(map(len, sessions)) == turns > 32 and all(sessions)  # some episodes took several turns
    assert None not in sessions[0] + sessions[1] and not set(sessions[0]) & set(sessions[1])
