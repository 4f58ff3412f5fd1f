"""examples/vision_shapes (issue 42): make_data.py draws the images and writes SkyRL's multimodal rows,
builds the tiny Qwen2.5-VL and warms it up by steps (the warm-up's batches are transformers'
processor's ids and image tensors); the config resolves (`--print-config`) and needs
generator.vision_language_generator for its image rows; a few fully-async and synchronous steps
train on the images end to end (engine in its own process, image rollouts, the trainer's forward
with pixel values, the weight sync)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from example_scripts import load_example

from inflight.config import ConfigError
from inflight.tasks.base_model import supervised_batch
from inflight.train.main import main, make_task, resolve_config

RECIPE = Path(__file__).resolve().parents[2] / "examples" / "vision_shapes"


def _make_data():
    return load_example("vision_shapes")


@pytest.fixture(scope="module")
def recipe(tmp_path_factory):
    """(data paths, model dir, warm-up report) of a small copy of the recipe: 3 warm-up steps."""
    out = tmp_path_factory.mktemp("vision_shapes")
    make_data = _make_data()
    paths = make_data.write_data(out, num_train=24, num_test=8, seed=1)
    report = make_data.build_model(
        out / "model", paths, steps=3, max_seconds=None, seed=1, log=lambda _: None
    )
    return paths, out / "model", report


def _overrides(recipe, *extra: str) -> list[str]:
    paths, model, _ = recipe
    return [f"data.train_data=[{paths['train']}]", f"data.val_data=[{paths['test']}]",
            f"trainer.policy.model.path={model}", *extra]


def test_the_recipe_writes_image_rows_and_warms_up_by_steps(recipe):
    paths, model, report = recipe
    assert report.steps == report.steps_asked == 3 and report.stopped_by == "steps"
    cfg, job = resolve_config(str(RECIPE / "config.yaml"), _overrides(recipe))
    assert cfg.generator.vision_language_generator and cfg.trainer.fully_async.enabled
    task = make_task(cfg, job)
    assert task.vision is not None and len(task.train_problems()) == 24 and len(task.eval_problems()) == 8
    problems = task.train_problems()[:3]
    colours = set(_make_data().COLOURS)
    assert all(p.answer in colours and task.reward(p, p.answer) == 1.0 for p in problems)
    batch = supervised_batch(task, problems)
    processor = task.vision.processor
    for row, p in enumerate(problems):
        parts = [{"type": "image"} if part["type"] == "image" else part for part in p.prompt[0]["content"]]
        text = processor.apply_chat_template([{"role": "user", "content": parts}], add_generation_prompt=True)
        image = next(part["image"] for part in p.prompt[0]["content"] if part["type"] == "image")
        want = processor(text=[text + p.answer], images=[image], return_tensors="pt")
        n = want["input_ids"].shape[1]
        assert torch.equal(batch["input_ids"][row, :n], want["input_ids"][0])
        assert batch["input_ids"][row, n] == task.tokenizer.eos_token_id
    sizes = {tuple(p.prompt[0]["content"][0]["image"].size) for p in task.train_problems()}
    assert len(sizes) > 1  # several image sizes
    with pytest.raises(ConfigError, match="generator.vision_language_generator"):
        make_task(*resolve_config(str(RECIPE / "config.yaml"),
                                  _overrides(recipe, "generator.vision_language_generator=false")))


def test_print_config_resolves_the_recipe(recipe, capsys):
    assert main(["--config", str(RECIPE / "config.yaml"), "--print-config", *_overrides(recipe)]) == 0
    assert "vision_language_generator: true" in capsys.readouterr().out


@pytest.mark.parametrize("fully_async", [True, False], ids=["fully_async", "synchronous"])
def test_a_few_steps_train_on_the_images(recipe, tmp_path, fully_async):
    out = tmp_path / "run"
    small = [
        "trainer.max_training_steps=2",
        "trainer.train_batch_size=4",
        "trainer.policy_mini_batch_size=4",
        "generator.n_samples_per_prompt=4",
        "trainer.fully_async.num_parallel_generation_workers=8",
        f"trainer.fully_async.enabled={str(fully_async).lower()}",
        "trainer.eval_interval=2",
        "trainer.algorithm.zero_variance_filter=false",
        f"job.output_dir={out}",
        "job.progress=false",
        "job.plot=false",
        "job.max_train_seconds=null",
    ]
    assert main(["--config", str(RECIPE / "config.yaml"), *_overrides(recipe, *small)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["samples"] == 2 * 4 * 4
    assert summary["before"] is not None and summary["after"] is not None
    steps = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "samples" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert all(r["groups_trained"] == 4 and math.isfinite(r["grad_norm"]) for r in steps)  # each step trained
