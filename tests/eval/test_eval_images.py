"""`inflight eval` on SkyRL's multimodal rows (examples/vision_shapes' data) with a tiny Qwen2.5-VL:
each image row is evaluated with its image, the greedy answers equal transformers'
`Qwen2_5_VLForConditionalGeneration.generate` on the processor's inputs for the same row."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from example_scripts import load_example
from PIL import Image
from transformers import Qwen2_5_VLForConditionalGeneration

from inflight.cli import main as inflight_main
from inflight.testing.tiny_vlm import load_tiny_processor, make_tiny_vlm

RECIPE = Path(__file__).resolve().parents[2] / "examples" / "vision_shapes"
MAX_TOKENS = 6


def _make_data():
    return load_example("vision_shapes")


@pytest.fixture(scope="module")
def recipe(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval-images")
    paths = _make_data().write_data(root, num_train=1, num_test=4, seed=3)
    return root, paths["test"], make_tiny_vlm(root / "model", seed=0)


def _oracle(model_dir: Path, image: Image.Image, text: str) -> str:
    processor = load_tiny_processor(model_dir)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True)
    inputs = processor(text=[prompt], images=[image], return_tensors="pt")
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False)
    new = out[0, inputs["input_ids"].shape[1]:]
    return processor.tokenizer.decode(new, skip_special_tokens=True)


def test_image_rows_are_evaluated_with_their_images(recipe, tmp_path):
    root, data, model_dir = recipe
    out = tmp_path / "eval"
    code = inflight_main(["eval", "--model", str(model_dir), "--data", str(data), "--output", str(out),
                          "--max-tokens", str(MAX_TOKENS), "--no-progress"])
    assert code == 0
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 4
    import datasets

    rows = datasets.Dataset.from_parquet(str(data)).to_list()
    for sample, row in zip(sorted(samples, key=lambda s: s["problem_id"]), rows, strict=True):
        image_part, text_part = row["prompt"][0]["content"]
        image = Image.open(root / image_part["image"]).convert("RGB")
        assert sample["response"] == _oracle(model_dir, image, text_part["text"]), sample["problem_id"]
