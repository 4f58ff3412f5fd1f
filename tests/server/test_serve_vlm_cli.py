"""`inflight serve --model <tiny Qwen2.5-VL dir>` in a subprocess, with no processor handed in: the
server loads the model's processor itself (image-only where transformers' AutoProcessor needs
torchvision), says which in its log, and answers an image chat request through the `openai` client
with the in-process engine's tokens on transformers' processor output."""

from __future__ import annotations

import base64
import io
import subprocess
import sys

import numpy as np
import openai
import pytest
from PIL import Image
from transformers.utils import is_torchvision_available

from inflight.engine import LLMEngine
from inflight.engine.multimodal import MultimodalInput
from inflight.engine.request import SamplingParams
from inflight.testing.tiny_vlm import load_tiny_processor, make_tiny_vlm
from tests.server.conftest import engine_config
from tests.server.test_server_entrypoint import free_port, wait_healthy

MAX_TOKENS = 6


def data_url(image: Image.Image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory):
    return make_tiny_vlm(tmp_path_factory.mktemp("served-vl"))


@pytest.fixture(scope="module")
def served(vl_dir):
    """(base url, the process) of `inflight serve` on the tiny VLM; its output read once it stops."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "inflight.cli", "serve", "--model", str(vl_dir), "--port", str(port),
         "--block-size", "4", "--threads", "1", "--log-level", "warning", "--served-model-name", "tiny-vl"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, timeout_s=180)
        yield url, proc
    finally:
        proc.kill()
        proc.wait(timeout=30)


def test_cli_server_answers_an_image_chat_as_the_engine(served, vl_dir):
    url, proc = served
    rng = np.random.default_rng(7)
    image = Image.fromarray(rng.integers(0, 256, (80, 130, 3), dtype=np.uint8), "RGB")
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    got = client.chat.completions.create(
        model="tiny-vl",
        temperature=0,
        max_tokens=MAX_TOKENS,
        extra_body={"return_token_ids": True},
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "what is this?"},
                    {"type": "image_url", "image_url": {"url": data_url(image)}},
                ],
            }
        ],
    )

    processor = load_tiny_processor(vl_dir)
    rendered = processor.tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "text", "text": "what is this?"}, {"type": "image"}]}],
        tokenize=False, add_generation_prompt=True)
    inputs = processor(text=[rendered], images=[image], return_tensors="pt", add_special_tokens=False)
    assert got.prompt_token_ids == inputs["input_ids"][0].tolist()
    engine = LLMEngine(engine_config(vl_dir))
    want = engine.generate(
        [inputs["input_ids"][0].tolist()],
        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
        multimodal=[MultimodalInput(inputs["pixel_values"], inputs["image_grid_thw"])],
    )[0]
    assert got.choices[0].token_ids == want.output_token_ids
    assert got.choices[0].message.content == processor.tokenizer.decode(
        want.output_token_ids, skip_special_tokens=True
    )

    proc.kill()
    proc.wait(timeout=30)
    log = proc.stdout.read().decode()
    if not is_torchvision_available():  # otherwise AutoProcessor's, logged at info
        assert "processor ImageOnlyQwen2_5_VLProcessor with Qwen2VLImageProcessorPil" in log, log[-2000:]
