"""Images through the server, with the official `openai` client, on a tiny random Qwen2.5-VL: the prompt
ids are what transformers' processor makes of the template's text and the image (placeholders
expanded), the answer is the in-process engine's on those ids and images, the Responses API's
`input_image` gives the same answer, and every bad image is a 400 naming the fault after which the
server answers the next request."""

from __future__ import annotations

import base64
import io

import numpy as np
import openai
import pytest
from PIL import Image

from inflight.chat.images import ImageLimits
from inflight.chat.vision import Vision
from inflight.engine import LLMEngine
from inflight.engine.multimodal import MultimodalInput
from inflight.engine.request import SamplingParams
from inflight.server.launch import serve_model
from inflight.testing.tiny_vlm import load_tiny_processor, make_tiny_vlm
from tests.server.conftest import engine_config

VL_NAME = "tiny-vl"
MAX_PIXELS = 200 * 200
MAX_BYTES = 64 * 1024
MAX_TOKENS = 6


def picture(width: int, height: int, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), "RGB")


def png(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def image_message(url: str, text: str = "what is this?") -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": text},
                                         {"type": "image_url", "image_url": {"url": url}}]}]


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory):
    return make_tiny_vlm(tmp_path_factory.mktemp("tiny-vl"))


@pytest.fixture(scope="module")
def media_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("media")
    (root / "cat.png").write_bytes(png(picture(90, 60, seed=3)))
    (root.parent / "outside.png").write_bytes(png(picture(90, 60, seed=3)))
    return root


@pytest.fixture(scope="module")
def processor(vl_dir):
    return load_tiny_processor(vl_dir)


@pytest.fixture(scope="module")
def vl_server(vl_dir, processor, media_root):
    vision = Vision(processor, ImageLimits(max_pixels=MAX_PIXELS, max_bytes=MAX_BYTES, local_root=media_root))
    srv = serve_model(engine_config(vl_dir), VL_NAME, vision=vision)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def vl_client(vl_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{vl_server.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def vl_reference(vl_dir) -> LLMEngine:
    return LLMEngine(engine_config(vl_dir))


def oracle_prompt(processor, images: list[Image.Image], text: str = "what is this?"):
    """transformers' processor on the template's rendering: the ids and tensors the server must make."""
    messages = [
        {"role": "user", "content": [{"type": "text", "text": text}] + [{"type": "image"}] * len(images)}
    ]
    rendered = processor.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return processor(text=[rendered], images=images, return_tensors="pt")


def engine_answer(engine: LLMEngine, inputs) -> list[int]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    mm = MultimodalInput(inputs["pixel_values"], inputs["image_grid_thw"])
    return engine.generate([inputs["input_ids"][0].tolist()], params, multimodal=[mm])[0].output_token_ids


def chat(client, messages, **extra):
    return client.chat.completions.create(
        model=VL_NAME,
        messages=messages,
        temperature=0,
        max_tokens=MAX_TOKENS,
        extra_body={"return_token_ids": True, **extra},
    )


def test_image_prompt_and_answer_equal_processor_and_engine(vl_client, processor, vl_reference):
    images = [picture(90, 60), picture(120, 150, seed=1)]
    messages = [{"role": "user", "content": [{"type": "text", "text": "what is this?"}] + [
        {"type": "image_url", "image_url": {"url": data_url(png(im))}} for im in images]}]
    got = chat(vl_client, messages)
    inputs = oracle_prompt(processor, images)
    want_ids = inputs["input_ids"][0].tolist()
    assert got.prompt_token_ids == want_ids
    pads = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    per_image = [int(g.prod()) // 4 for g in inputs["image_grid_thw"]]  # merge size 2: 2x2 patches per token
    assert want_ids.count(pads) == sum(per_image) and min(per_image) > 1
    assert got.choices[0].token_ids == engine_answer(vl_reference, inputs)
    assert got.usage.prompt_tokens == len(want_ids)


def test_local_file_under_the_root_and_responses_input_image(vl_client, processor, vl_reference, media_root):
    image = picture(90, 60, seed=3)
    want = engine_answer(vl_reference, oracle_prompt(processor, [image]))
    assert chat(vl_client, image_message(f"file://{media_root}/cat.png")).choices[0].token_ids == want
    by_data = chat(vl_client, image_message(data_url(png(image))))
    assert by_data.choices[0].token_ids == want
    response = vl_client.responses.create(
        model=VL_NAME,
        temperature=0,
        max_output_tokens=MAX_TOKENS,
        input=[
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "what is this?"},
                    {"type": "input_image", "image_url": data_url(png(image)), "detail": "auto"},
                ],
            }
        ],
    )
    assert response.output_text == by_data.choices[0].message.content


def test_text_only_request_on_the_vision_model(vl_client, processor, vl_reference):
    got = chat(vl_client, [{"role": "user", "content": [{"type": "text", "text": "hello"}]}])
    ids = processor.tokenizer.apply_chat_template(
        [{"role": "user", "content": "hello"}], add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]
    assert got.prompt_token_ids == list(ids)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    assert got.choices[0].token_ids == vl_reference.generate([list(ids)], params)[0].output_token_ids


BIG = Image.new("RGB", (201, 200), (10, 200, 30))  # over MAX_PIXELS (40000) by one column, a small PNG
NOISY = picture(180, 180, seed=5)  # under the pixel limit, over MAX_BYTES as a PNG of noise


@pytest.mark.parametrize(
    "content, code, words",
    [
        (
            [{"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}],
            "image_url_not_allowed",
            "no network access",
        ),
        ([{"type": "image_url", "image_url": {"url": "/etc/passwd"}}], "image_url_not_allowed", "is outside"),
        (
            [{"type": "image_url", "image_url": {"url": data_url(b"GIF89a not really")}}],
            "invalid_image",
            "unreadable image",
        ),
        (
            [{"type": "image_url", "image_url": {"url": "data:image/png;base64,%%%"}}],
            "invalid_image",
            "not valid base64",
        ),
        (
            [{"type": "image_url", "image_url": {"url": data_url(png(BIG))}}],
            "image_too_large",
            "201x200 = 40200 pixels, over the limit of 40000",
        ),
        (
            [{"type": "image_url", "image_url": {"url": data_url(png(NOISY))}}],
            "image_too_large",
            f"over the limit of {MAX_BYTES} bytes",
        ),
        ([{"type": "audio", "audio": "x"}], "unsupported_content", "'audio' is not supported"),
    ],
)
def test_bad_images_are_400s_naming_the_fault(vl_client, content, code, words):
    messages = [{"role": "user", "content": [{"type": "text", "text": "look"}, *content]}]
    with pytest.raises(openai.BadRequestError) as err:
        chat(vl_client, messages)
    body = err.value.body
    assert words in body["message"] and body["code"] == code, body
    assert body["param"] == "messages[0].content[1]"
    assert chat(vl_client, [{"role": "user", "content": "still there?"}]).choices[0].finish_reason


def test_outside_file_and_file_id_refused(vl_client, media_root):
    with pytest.raises(openai.BadRequestError, match="is outside"):
        chat(vl_client, image_message(f"file://{media_root.parent}/outside.png"))
    with pytest.raises(openai.BadRequestError, match="stores no files") as err:
        vl_client.responses.create(model=VL_NAME, max_output_tokens=2, input=[
            {"role": "user", "content": [{"type": "input_image", "file_id": "file-123"}]}])
    assert err.value.body["param"] == "input[0].content[0]"


def test_image_to_a_text_only_model_is_a_400(client, server):
    with pytest.raises(openai.BadRequestError, match="this model is text-only") as err:
        client.chat.completions.create(model=server.model_name, max_tokens=2,
                                       messages=image_message(data_url(png(picture(8, 8)))))
    assert err.value.body["param"] == "messages[0].content[1]"
    with pytest.raises(openai.BadRequestError, match="text-only"):
        client.responses.create(
            model=server.model_name,
            max_output_tokens=2,
            input=[
                {
                    "role": "user",
                    "content": [{"type": "input_image", "image_url": data_url(png(picture(8, 8)))}],
                }
            ],
        )
    assert client.chat.completions.create(model=server.model_name, max_tokens=2,
                                          messages=[{"role": "user", "content": "hi"}]).choices


def test_image_flags(tmp_path):
    from inflight.chat.images import DEFAULT_MAX_IMAGE_BYTES
    from inflight.server.main import build_parser, image_limits

    args = build_parser().parse_args(["--model", "m", "--max-image-pixels", "100",
                                      "--allowed-local-media-path", str(tmp_path)])
    assert image_limits(args) == ImageLimits(100, DEFAULT_MAX_IMAGE_BYTES, tmp_path.resolve())
    args = build_parser().parse_args(["--model", "m", "--max-image-pixels", "0", "--max-image-bytes", "0"])
    assert image_limits(args) == ImageLimits(None, None, None)
    args = build_parser().parse_args(["--model", "m", "--allowed-local-media-path", str(tmp_path / "no")])
    with pytest.raises(ValueError, match="is not a folder"):
        image_limits(args)
