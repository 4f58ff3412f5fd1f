"""Rollouts with images on the tiny Qwen2.5-VL (issue 42): the opening's images go to the engine with
every turn's request and stay with the trajectory; an observation message holding an image (SkyRL's
environments may return them) adds its placeholders, expanded by transformers' processor, and its
image after the opening's. Checked against transformers: the prompt ids and image tensors are its
processor's, and the engine's logprobs of both turns' sampled tokens equal
`Qwen2_5_VLForConditionalGeneration`'s forward over the whole episode with every image in it. A
sampled image placeholder ends the turn without it; images to a task without a processor fail the
episode, naming why."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import numpy as np
import pytest
import torch
from PIL import Image
from scripted_client import ScriptedClient
from tolerance import assert_close_to_reference, other_thread_count
from transformers import Qwen2_5_VLForConditionalGeneration

from inflight.chat.turns import ChatFormat
from inflight.chat.vision import Vision
from inflight.client import LocalClient
from inflight.engine import AsyncEngine, EngineConfig, LLMEngine
from inflight.rollout import TaskGenerator
from inflight.rollout.trajectory import ENV_VERSION
from inflight.tasks.base import Environment, Problem, StepResult, Task
from inflight.testing.tiny_vlm import load_tiny_processor, make_tiny_vlm


def picture(height: int, width: int, seed: int) -> Image.Image:
    return Image.fromarray(np.random.RandomState(seed).randint(0, 255, (height, width, 3), dtype=np.uint8))


OPENING_IMAGE, OBSERVED_IMAGE = picture(60, 90, 1), picture(84, 112, 2)


class LookAgainEnv(Environment):
    """Two turns: after the first, a user message holding a second image."""

    max_turns = 2

    def __init__(self, problem: Problem) -> None:
        self.problem, self.turns = problem, 0

    def reset(self):
        return self.problem.prompt

    def step(self, response: str) -> StepResult:
        self.turns += 1
        look = [{"role": "user", "content": [{"type": "image", "image": OBSERVED_IMAGE},
                                             {"type": "text", "text": "and this?"}]}]
        return StepResult(look if self.turns == 1 else None, 0.5, self.turns >= 2)


class ImageTask(Task):
    """Chat prompts holding an image; turns end at any of a third of the vocabulary."""

    chat_format = ChatFormat()

    def __init__(self, processor, vision: bool = True) -> None:
        super().__init__(processor.tokenizer)
        self.vision = Vision(processor) if vision else None
        content = [{"type": "image", "image": OPENING_IMAGE}, {"type": "text", "text": "what is it?"}]
        self.problems = [Problem("p0", [{"role": "user", "content": content}], "")]

    def train_problems(self) -> Sequence[Problem]:
        return self.problems

    def eval_problems(self) -> Sequence[Problem]:
        return self.problems

    def reward(self, problem: Problem, response: str) -> float:
        return 0.0

    def make_env(self, problem: Problem) -> Environment:
        return LookAgainEnv(problem)

    @property
    def stop_token_ids(self) -> list[int]:  # a random model then ends its turns after a few tokens
        return [self.tokenizer.eos_token_id, *range(3, len(self.tokenizer), 3)]


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory):
    return make_tiny_vlm(tmp_path_factory.mktemp("tiny-vl"), seed=6)


@pytest.fixture(scope="module")
def processor(vl_dir):
    return load_tiny_processor(vl_dir)


def play(vl_dir, task):
    async def main():
        engine = AsyncEngine(LLMEngine(EngineConfig(model=str(vl_dir), block_size=8)))
        try:
            gen = TaskGenerator(LocalClient(engine), task, n=2, seed=3, max_tokens=5, max_turns=2)
            return await gen(task.problems[0])
        finally:
            await engine.close()

    return asyncio.run(main())


@torch.no_grad()
def _logprobs(model, inputs: dict, traj) -> torch.Tensor:
    """transformers' logprob of each response token, teacher-forced over the whole episode."""
    logits = model(**inputs).logits[0, len(traj.prompt_ids) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(traj.response_ids)[:, None])[:, 0]


def test_images_go_with_every_turn_and_stay_with_the_trajectory(vl_dir, processor):
    group = play(vl_dir, ImageTask(processor))
    opening = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what is it?"}]}]
    text = processor.apply_chat_template(opening, add_generation_prompt=True)
    expected = processor(text=[text], images=[OPENING_IMAGE], return_tensors="pt")
    both = processor.image_processor(images=[OPENING_IMAGE, OBSERVED_IMAGE], return_tensors="pt")
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(str(vl_dir), dtype=torch.float32).eval()
    got, want, variant = [], [], []
    for traj in group.trajectories:
        assert traj.prompt_ids == expected["input_ids"][0].tolist()
        assert traj.num_turns == 2, traj.finish_reason
        assert torch.equal(traj.images.pixel_values, both["pixel_values"])
        assert torch.equal(traj.images.image_grid_thw, both["image_grid_thw"])
        ids = torch.tensor([traj.prompt_ids + traj.response_ids])
        observed = [i for i, v in enumerate(traj.versions) if v == ENV_VERSION]
        merged = int(both["image_grid_thw"][1].prod()) // processor.image_processor.merge_size**2
        # the observation's image
        assert sum(t == processor.image_token_id for t in traj.response_ids) == merged
        assert all(
            traj.response_ids[i] != processor.image_token_id for i, m in enumerate(traj.loss_mask) if m
        )
        inputs = dict(
            input_ids=ids, pixel_values=traj.images.pixel_values, image_grid_thw=traj.images.image_grid_thw,
            mm_token_type_ids=ids.eq(processor.image_token_id).int(),
        )

        sampled = [i for i in range(len(traj.response_ids)) if i not in observed]
        got += [traj.logprobs[i] for i in sampled]
        want.append(_logprobs(model, inputs, traj)[sampled])
        with other_thread_count():
            variant.append(_logprobs(model, inputs, traj)[sampled])
    assert_close_to_reference(
        torch.tensor(got), torch.cat(want), [torch.cat(variant)], what="episode logprobs"
    )


def test_a_sampled_placeholder_ends_the_turn_without_it(processor):
    task = ImageTask(processor)
    pad, eos = processor.image_token_id, processor.tokenizer.eos_token_id
    client = ScriptedClient([([40, 41, pad], "stop"), ([42, eos], "stop")])
    gen = TaskGenerator(client, task, n=1, max_tokens=5, max_turns=2)
    assert pad in gen.stop_token_ids
    traj = asyncio.run(gen.episode(task.problems[0]))
    assert traj.response_ids[:2] == [40, 41] and traj.response_ids[-2:] == [42, eos]
    assert [traj.response_ids[i] for i, m in enumerate(traj.loss_mask) if m] == [40, 41, 42, eos]


def test_images_without_a_processor_fail_the_episode_naming_why(processor):
    task = ImageTask(processor, vision=False)
    traj = asyncio.run(TaskGenerator(ScriptedClient([]), task, n=1).episode(task.problems[0]))
    assert traj.rollout_failed and "no image processor" in traj.info["rollout_error"]
