"""Stop strings in training, on a real engine: with the same per-sample seeds, a run with a stop
string samples the same tokens as one without, up to and including the token that completed the
stop string, and no further; the reward sees the text without it (or with it, as asked)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest
from transformers import AutoTokenizer

from inflight.client import LocalClient
from inflight.engine import AsyncEngine, EngineConfig, LLMEngine
from inflight.rollout.task_generator import TaskGenerator, request_seed
from inflight.tasks.base import Problem, Task


class RecordingTask(Task):
    """Chat prompts, single turn; the reward records the text it was given."""

    def __init__(self, tokenizer) -> None:
        super().__init__(tokenizer)
        self.problems = [
            Problem(f"p{i}", [{"role": "user", "content": f"say {i} words"}], "") for i in range(2)
        ]
        self.seen: list[str] = []

    def train_problems(self) -> Sequence[Problem]:
        return self.problems

    def eval_problems(self) -> Sequence[Problem]:
        return self.problems

    def reward(self, problem: Problem, response: str) -> float:
        self.seen.append(response)
        return 0.0

    def encode_prompt(self, prompt) -> list[int]:
        return self.encode_chat(prompt)


class CountingClient(LocalClient):
    """Records how many tokens the engine generated per request, by the request's seed."""

    async def generate(self, prompt_token_ids, params=None, **kwargs):
        out = await super().generate(prompt_token_ids, params, **kwargs)
        self.generated[params.seed] = len(out.output_token_ids)
        return out


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory):
    return tiny_model_factory("qwen2", seed=2)


def sample(model_dir, **kwargs):
    tok = AutoTokenizer.from_pretrained(model_dir)
    task = RecordingTask(tok)

    async def main():
        engine = AsyncEngine(
            LLMEngine(EngineConfig(model=str(model_dir), num_kv_blocks=128, max_num_seqs=32))
        )
        client = CountingClient(engine)
        client.generated = {}
        try:
            gen = TaskGenerator(client, task, n=4, seed=9, max_tokens=24, **kwargs)
            groups = [await gen(p) for p in task.problems]
            return [t for g in groups for t in g.trajectories], client.generated
        finally:
            await engine.close()

    trajs, generated = asyncio.run(main())
    sample.task = task
    return tok, trajs, generated


def test_a_stop_string_ends_the_turn_at_the_token_that_completed_it(model_dir):
    tok, free, _ = sample(model_dir)
    decode = lambda ids: tok.decode(ids, skip_special_tokens=True)  # noqa: E731
    text = decode(free[0].response_ids)
    assert len(text) >= 12
    stop = text[6:9]  # three characters, wherever the token boundaries fall
    for include, append_eos in ((False, True), (True, True), (False, False)):
        _, cut, _ = sample(model_dir, stop=[stop], include_stop_str_in_output=include,
                           append_eos_token_after_stop_str_in_multi_turn=append_eos)
        hits = 0
        for full, short in zip(free, cut, strict=True):
            whole = decode(full.response_ids)
            if stop not in whole:
                assert short.response_ids == full.response_ids
                continue
            hits += 1
            n = next(k for k in range(1, len(full.response_ids) + 1) if stop in decode(full.response_ids[:k]))
            # the sampled tokens up to the stop string, then (SkyRL's default) the EOS, not trained on
            eos = [tok.eos_token_id] if append_eos else []
            assert short.response_ids == full.response_ids[:n] + eos and short.finish_reason == "stop"
            assert short.logprobs == full.logprobs[:n] + [0.0] * len(eos)
            assert short.loss_mask == [1] * n + [0] * len(eos) and short.turn_rewards == [(n - 1, 0.0)]
        assert hits >= 1


def test_the_reward_sees_the_text_without_the_stop_string_unless_asked(model_dir):
    tok, free, _ = sample(model_dir)
    texts = [tok.decode(t.response_ids, skip_special_tokens=True) for t in free]
    stop = texts[0][6:9]
    for include in (False, True):
        sample(model_dir, stop=[stop], include_stop_str_in_output=include)
        cut = [t[: t.index(stop) + (len(stop) if include else 0)] if stop in t else t for t in texts]
        assert sorted(sample.task.seen) == sorted(cut)


def test_a_stop_string_one_token_spells_stops_the_engine_there(model_dir):
    tok, free, generated_free = sample(model_dir)
    ids = free[0].response_ids
    word = next(tok.decode([i]) for i in ids[2:-2]
                if tok(tok.decode([i]), add_special_tokens=False)["input_ids"] == [i])
    _, cut, generated = sample(model_dir, stop=[word])
    n = next(k for k in range(1, len(ids) + 1) if word in tok.decode(ids[:k], skip_special_tokens=True))
    assert cut[0].response_ids == ids[:n] + [tok.eos_token_id] and cut[0].loss_mask == [1] * n + [0]
    first = request_seed(9, 0, "p0", 0, 0)  # the seed of the first sample's only turn
    assert generated[first] == n < generated_free[first]  # the engine stopped at the stop token
