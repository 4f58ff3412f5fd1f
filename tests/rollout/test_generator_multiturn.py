"""Multi-turn chat episodes on a real engine (a tiny Qwen2 with a BPE tokenizer and a ChatML
template): token-in/token-out checked against transformers (the rollout log-probabilities of every
sampled token, recomputed over the whole trajectory, agree: each turn was generated from exactly the
trajectory before it) and against the tokenizer's own `apply_chat_template` (every stretch the model
did not sample is what the template writes between the turns)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest
import torch
from rl_support import mask_runs
from transformers import AutoTokenizer

from inflight.client import LocalClient
from inflight.engine import AsyncEngine, EngineConfig, LLMEngine
from inflight.rollout.task_generator import ENV_VERSION, TaskGenerator
from inflight.tasks.base import Environment, Problem, StepResult, Task
from inflight.train.losses import token_logprobs
from inflight.train.step import build_batch

NUDGE = {"role": "user", "content": "go on"}


class NudgeEnv(Environment):
    """Answers every turn with a user message, for `max_turns` turns; reward 1 per turn."""

    max_turns = 4

    def __init__(self, problem: Problem) -> None:
        self.problem = problem

    def reset(self):
        return self.problem.prompt

    def step(self, response: str) -> StepResult:
        return StepResult([NUDGE], 0.25, False)


class ChatTask(Task):
    """Chat prompts through the template; turns end at any of a third of the vocabulary (a random
    model then ends turns after a few tokens, with finish_reason "stop")."""

    def __init__(self, tokenizer) -> None:
        super().__init__(tokenizer)
        self.problems = [
            Problem(f"p{i}", [{"role": "user", "content": f"count to {i}"}], "") for i in range(3)
        ]

    def train_problems(self) -> Sequence[Problem]:
        return self.problems

    def eval_problems(self) -> Sequence[Problem]:
        return self.problems

    def reward(self, problem: Problem, response: str) -> float:
        return 0.0

    def make_env(self, problem: Problem) -> Environment:
        return NudgeEnv(problem)

    @property
    def stop_token_ids(self) -> list[int]:
        return [self.tokenizer.eos_token_id, *range(3, len(self.tokenizer), 3)]

    def encode_prompt(self, prompt) -> list[int]:
        return self.encode_chat(prompt)


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory):
    return tiny_model_factory("qwen2", seed=1)


def play(model_dir, task, **kwargs):
    async def main():
        engine = AsyncEngine(
            LLMEngine(EngineConfig(model=str(model_dir), num_kv_blocks=128, max_num_seqs=32))
        )
        try:
            gen = TaskGenerator(LocalClient(engine), task, n=6, seed=5, max_tokens=8, **kwargs)
            return [await gen(p) for p in task.train_problems()]
        finally:
            await engine.close()

    return asyncio.run(main())


def test_multi_turn_chat_is_token_in_token_out(model_dir, hf_model_factory):
    tok = AutoTokenizer.from_pretrained(model_dir)
    task = ChatTask(tok)
    groups = play(model_dir, task)
    trajs = [t for g in groups for t in g.trajectories]
    multi = [t for t in trajs if t.num_turns > 1]
    assert len(multi) >= 3, [t.num_turns for t in trajs]
    eos = tok.eos_token_id
    for g in groups:
        for t in g.trajectories:
            want = tok.apply_chat_template(g.problem.prompt, add_generation_prompt=True, return_dict=True)
            assert t.prompt_ids == list(want["input_ids"])
    for t in multi:
        pieces = mask_runs(t)
        assert [m for m, _ in pieces] == [1, 0] * (t.num_turns - 1) + [1]
        history = list(next(g.problem for g in groups if t in g.trajectories).prompt)
        for k in range(t.num_turns - 1):
            sampled, between = pieces[2 * k][1], pieces[2 * k + 1][1]
            content = tok.decode(sampled, skip_special_tokens=True)
            before = tok.apply_chat_template(history, tokenize=False, add_generation_prompt=True) + content
            history += [{"role": "assistant", "content": content}, NUDGE]
            after = tok.apply_chat_template(history, tokenize=False, add_generation_prompt=True)
            assert after.startswith(before)
            want = tok(after[len(before):], add_special_tokens=False)["input_ids"]
            if sampled[-1] == eos:  # the model sampled the template's end of turn itself
                want = want[1:]
            assert between == want
        assert t.reward == pytest.approx(0.25 * t.num_turns)
        env = [i for i, m in enumerate(t.loss_mask) if m == 0]
        assert all(t.versions[i] == ENV_VERSION and t.logprobs[i] == 0.0 for i in env)
    # every sampled token's rollout log-probability is the model's over the whole trajectory
    model = hf_model_factory(model_dir)
    batch = build_batch(groups, torch.zeros(len(trajs)), pad_id=tok.pad_token_id)
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    mask = batch.loss_mask > 0
    recomputed = token_logprobs(logits, batch.input_ids, 1.0)
    torch.testing.assert_close(recomputed[mask], batch.rollout_logprobs[mask], atol=2e-4, rtol=1e-4)


def test_generator_max_turns_does_not_override_an_environments_own(model_dir):
    tok = AutoTokenizer.from_pretrained(model_dir)
    task = ChatTask(tok)
    trajs = [t for g in play(model_dir, task, max_turns=1) for t in g.trajectories]
    assert max(t.num_turns for t in trajs) > 1  # NudgeEnv.max_turns = 4 wins
    NudgeEnv.max_turns = None
    try:
        trajs = [t for g in play(model_dir, task, max_turns=2) for t in g.trajectories]
    finally:
        NudgeEnv.max_turns = 4
    assert max(t.num_turns for t in trajs) == 2
