"""SkyRL's multimodal rows (chat messages whose content holds image parts) through our dataset loader:
images as data URLs, relative paths, bare base64 and datasets' Parquet `{"bytes", "path"}` struct
decode to the pixels written; a prompt's length is what transformers' Qwen2.5-VL processor makes of
it; a row with a bad image is left out and counted with its reason, and the run goes on."""

from __future__ import annotations

import base64
import io
import json

import datasets
import numpy as np
import pytest
from PIL import Image

from inflight.chat.images import ImageLimits
from inflight.chat.vision import Vision
from inflight.tasks.data_task import DataTask
from inflight.tasks.dataset import DatasetError, image_prompt, load_problems
from inflight.testing.tiny_vlm import load_tiny_processor, make_tiny_vlm


def picture(width: int, height: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), "RGB")


def png(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def row(part: dict, answer: str) -> dict:
    return {"prompt": [{"role": "user", "content": [{"type": "text", "text": "what colour?"}, part]}],
            "env_class": "exact", "reward_spec": {"method": "rule", "ground_truth": answer}}


@pytest.fixture(scope="module")
def processor(tmp_path_factory):
    return load_tiny_processor(make_tiny_vlm(tmp_path_factory.mktemp("vl")))


@pytest.fixture
def rows_file(tmp_path):
    (tmp_path / "imgs").mkdir()
    (tmp_path / "imgs" / "b.png").write_bytes(png(picture(70, 80, 1)))
    rows = [
        row(
            {
                "type": "image_url",
                "image_url": {
                    "url": "data:image/png;base64," + base64.b64encode(png(picture(60, 60, 0))).decode()
                },
            },
            "a",
        ),
        row({"type": "image", "image": "imgs/b.png"}, "b"),
        row({"type": "image", "image": base64.b64encode(png(picture(90, 56, 2))).decode()}, "c"),
        row({"type": "image_url", "image_url": {"url": "data:image/png;base64,aGVsbG8="}}, "bad"),  # "hello"
        row({"type": "image", "image": "imgs/missing.png"}, "missing"),
        row({"type": "image", "image": base64.b64encode(png(Image.new("RGB", (300, 300)))).decode()}, "big"),
        {
            "prompt": [{"role": "user", "content": "no image here"}],
            "env_class": "exact",
            "reward_spec": {"method": "rule", "ground_truth": "d"},
        },
    ]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_rows_with_images_load_and_bad_ones_are_counted(rows_file, processor):
    vision = Vision(processor, ImageLimits(max_pixels=250 * 250))
    task = DataTask(processor.tokenizer, [rows_file], [rows_file], vision=vision, max_prompt_length=512)
    refused = task.report.refused_image_rows
    assert len(refused) == 2 * 3  # train and held-out both read the file
    assert "rows.jsonl: row 4: column prompt[0].content[1]: unreadable image" in refused[0]
    assert "row 5: column prompt[0].content[1]: 'imgs/missing.png' is neither an image file" in refused[1]
    assert "row 6" in refused[2] and "300x300 = 90000 pixels, over the limit of 62500" in refused[2]
    assert "refused 6 rows with a bad image" in task.report.summary()
    problems = {p.answer: p for p in task.train_problems()}
    assert sorted(problems) == ["a", "b", "c", "d"] and task.report.train_rows == 4
    for answer, seed, size in [("a", 0, (60, 60)), ("b", 1, (70, 80)), ("c", 2, (90, 56))]:
        image = problems[answer].prompt[0]["content"][1]["image"]
        assert np.array_equal(np.asarray(image), np.asarray(picture(*size, seed)))
        rendered = processor.tokenizer.apply_chat_template(
            [{"role": "user", "content": [{"type": "text", "text": "what colour?"}, {"type": "image"}]}],
            tokenize=False, add_generation_prompt=True)
        want = processor(text=[rendered], images=[picture(*size, seed)], return_tensors="pt")
        assert problems[answer].meta["prompt_tokens"] == want["input_ids"].shape[1]
        got = image_prompt(task, problems[answer].prompt)
        assert got.token_ids == want["input_ids"][0].tolist()
        assert (
            got.pixel_values.equal(want["pixel_values"])
            and got.image_grid_thw.equal(want["image_grid_thw"])
        )
    assert task.encode_prompt(problems["d"].prompt) == processor.tokenizer.apply_chat_template(
        problems["d"].prompt, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]


def test_without_refused_the_first_bad_row_raises(rows_file):
    with pytest.raises(DatasetError, match="row 4: column prompt.0..content.1.: unreadable image"):
        load_problems(rows_file)


def test_images_need_an_image_processor(rows_file, processor):
    with pytest.raises(
        DatasetError, match=r"rows hold images \(e.g. .*rows.jsonl:1\), but this task has no image"
    ):
        DataTask(processor.tokenizer, [rows_file], [rows_file])


def test_every_row_bad_is_an_error(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(row({"type": "image", "image": "nope.png"}, "x")) + "\n")
    with pytest.raises(DatasetError, match="every row has a bad image"):
        load_problems(path, refused=[])


def test_parquet_image_struct(tmp_path):
    image = picture(40, 30, 7)
    parts = [{"type": "text", "text": "what?", "image": None},
             {"type": "image", "text": None, "image": {"bytes": png(image), "path": None}}]
    datasets.Dataset.from_list([{"prompt": [{"role": "user", "content": parts}], "answer": "x"}]).to_parquet(
        str(tmp_path / "rows.parquet"))
    (problem,) = load_problems(tmp_path / "rows.parquet")
    content = problem.prompt[0]["content"]
    assert content[0] == {"type": "text", "text": "what?"}
    assert np.array_equal(np.asarray(content[1]["image"]), np.asarray(image))
