"""`load_vision` without torchvision: transformers' AutoProcessor cannot build a Qwen2.5-VL processor
(its video processor needs torchvision), so the loader falls back to the family's processor without
the video part, from the directory's files. Its outputs equal transformers' own parts used directly
(the PIL image processor, the tokenizer, the chat template), with the settings the directory holds."""

from __future__ import annotations

import json
import logging
import shutil

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoProcessor, AutoTokenizer, LlavaProcessor
from transformers.models.qwen2_5_vl.processing_qwen2_5_vl import Qwen2_5_VLProcessor
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.utils import is_torchvision_available

from inflight.chat.image_only import image_only
from inflight.chat.vision import load_vision
from inflight.testing.tiny_vlm import MAX_PIXELS, MERGE_SIZE, MIN_PIXELS, PATCH_SIZE, make_tiny_vlm

pytestmark = pytest.mark.skipif(
    is_torchvision_available(), reason="the fallback is for transformers without torchvision"
)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_vlm(tmp_path_factory.mktemp("vl"))


@pytest.fixture(scope="module")
def hub_dir(tiny_dir, tmp_path_factory):
    """The tiny model in the layout of the Hub's Qwen2.5-VL checkpoints: a flat preprocessor_config.json
    naming Qwen2_5_VLProcessor (transformers' video processor reads it as its own config)."""
    path = tmp_path_factory.mktemp("hub") / "vl"
    shutil.copytree(tiny_dir, path)
    nested = json.loads((path / "processor_config.json").read_text())
    (path / "processor_config.json").unlink()
    flat = {**nested["image_processor"], "processor_class": nested["processor_class"]}
    (path / "preprocessor_config.json").write_text(json.dumps(flat))
    return path


def picture(width: int, height: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), "RGB")


def test_autoprocessor_needs_torchvision_for_a_hub_layout(hub_dir):
    with pytest.raises(ImportError, match="Torchvision"):
        AutoProcessor.from_pretrained(hub_dir)


@pytest.mark.parametrize("layout", ["tiny_dir", "hub_dir"])
def test_load_vision_falls_back_to_the_image_only_processor_and_says_so(layout, request, caplog):
    model_dir = request.getfixturevalue(layout)
    with caplog.at_level(logging.INFO, logger="inflight.chat.vision"):
        processor = load_vision(model_dir).processor
    assert isinstance(processor, Qwen2_5_VLProcessor) and not hasattr(processor, "video_processor")
    assert type(processor.image_processor) is Qwen2VLImageProcessorPil
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "ImageOnlyQwen2_5_VLProcessor with Qwen2VLImageProcessorPil" in said and "torchvision" in said


@pytest.mark.parametrize("layout", ["tiny_dir", "hub_dir"])
def test_outputs_equal_transformers_image_processor_and_tokenizer(layout, request):
    model_dir = request.getfixturevalue(layout)
    processor = load_vision(model_dir).processor
    # the oracle: transformers' PIL image processor with the tiny model's settings (not the class's
    # defaults: a loader that dropped the directory's settings differs), the directory's tokenizer
    oracle_images = Qwen2VLImageProcessorPil(
        min_pixels=MIN_PIXELS,
        max_pixels=MAX_PIXELS,
        patch_size=PATCH_SIZE,
        merge_size=MERGE_SIZE,
        temporal_patch_size=2,
    )
    assert oracle_images.size != Qwen2VLImageProcessorPil().size
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    images = [picture(90, 60, 0), picture(230, 300, 1), picture(57, 57, 2)]
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "image"},
                {"type": "text", "text": "and"},
                {"type": "image"},
                {"type": "image"},
                {"type": "text", "text": "what are these?"},
            ],
        }
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == text

    out = processor(text=[text], images=images, return_tensors="pt", add_special_tokens=False)
    want = oracle_images(images, return_tensors="pt")
    torch.testing.assert_close(out["pixel_values"], want["pixel_values"], rtol=0, atol=0)
    assert out["image_grid_thw"].tolist() == want["image_grid_thw"].tolist()
    counts = (want["image_grid_thw"].prod(-1) // MERGE_SIZE**2).tolist()
    assert len(set(counts)) == 3  # three sizes: a swapped or shared count shows
    expanded = text
    for n in counts:  # each placeholder becomes its image's merged-patch count of image tokens
        expanded = expanded.replace("<|image_pad|>", "<|placeholder|>" * n, 1)
    expanded = expanded.replace("<|placeholder|>", "<|image_pad|>")
    assert out["input_ids"][0].tolist() == tokenizer(expanded, add_special_tokens=False)["input_ids"]


def test_saved_directory_names_the_family_for_autoprocessor(tiny_dir):
    saved = json.loads((tiny_dir / "processor_config.json").read_text())
    assert saved["processor_class"] == "Qwen2_5_VLProcessor"  # where torchvision is installed, it loads


def test_only_image_tokenizer_video_processors_have_an_image_only_variant():
    assert image_only(Qwen2_5_VLProcessor) is image_only(Qwen2_5_VLProcessor)
    with pytest.raises(ValueError, match="LlavaProcessor has the sub-processors"):
        image_only(LlavaProcessor)


def test_a_text_only_model_has_no_vision(tiny_model_factory):
    assert load_vision(tiny_model_factory("qwen2")) is None
