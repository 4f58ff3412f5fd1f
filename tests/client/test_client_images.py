"""A generate request with images (`multimodal=MultimodalInput`) through every client: in process
(LocalClient, streaming too), an engine process (ProcessClient) and HTTP (RemoteClient over the
server's token route) give transformers' greedy tokens for the tiny Qwen2.5-VL, and the engine's
logprobs; images to a text-only model and malformed images on the wire are refused (issue 42)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import Qwen2_5_VLForConditionalGeneration

from inflight.client import LocalClient, RemoteClient
from inflight.client.process import EngineProcess
from inflight.engine import AsyncEngine, EngineConfig, InvalidRequestError, LLMEngine, SamplingParams
from inflight.engine.multimodal import MultimodalInput
from inflight.server.launch import serve_model
from inflight.testing.tiny_vlm import load_tiny_processor, make_tiny_vlm

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=True)


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory):
    return make_tiny_vlm(tmp_path_factory.mktemp("tiny-vl"), seed=2)


@pytest.fixture(scope="module")
def request_inputs(vl_dir):
    """(prompt ids, images, the processor's output) of a prompt with two images of different sizes, from
    transformers' processor."""
    processor = load_tiny_processor(vl_dir)
    rng = np.random.RandomState(4)
    images = [
        Image.fromarray(rng.randint(0, 255, (h, w, 3), dtype=np.uint8)) for h, w in ((60, 90), (112, 84))
    ]
    parts = [{"type": "image"}, {"type": "text", "text": "and"}, {"type": "image"}]
    text = processor.apply_chat_template([{"role": "user", "content": parts}], add_generation_prompt=True)
    out = processor(text=[text], images=images, return_tensors="pt", return_mm_token_type_ids=True)
    return out["input_ids"][0].tolist(), MultimodalInput(out["pixel_values"], out["image_grid_thw"]), out


@pytest.fixture(scope="module")
def expected(vl_dir, request_inputs):
    """transformers' greedy tokens, and the in-process engine's output (its logprobs)."""
    ids, mm, inputs = request_inputs
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(str(vl_dir), dtype=torch.float32).eval()
    with torch.no_grad():  # transformers computes M-RoPE from mm_token_type_ids
        out = model.generate(**inputs, max_new_tokens=6, min_new_tokens=6, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
    engine = LLMEngine(EngineConfig(model=str(vl_dir), block_size=8))
    return out[0, len(ids):].tolist(), engine.generate([ids], GREEDY, multimodal=[mm])[0]


def _check(got, expected) -> None:
    tokens, engine_out = expected
    assert got.output_token_ids == tokens
    assert got.logprobs == pytest.approx(engine_out.logprobs, rel=1e-5, abs=1e-6)


def test_local_client_sends_the_images(vl_dir, request_inputs, expected):
    ids, mm, _ = request_inputs

    async def run():
        engine = AsyncEngine(LLMEngine(EngineConfig(model=str(vl_dir), block_size=8)))
        client = LocalClient(engine)
        try:
            whole = await client.generate(ids, GREEDY, multimodal=mm)
            streamed = [s async for s in client.generate_stream(ids, GREEDY, multimodal=mm)][-1]
            with pytest.raises(InvalidRequestError):  # the placeholders need their images
                await client.generate(ids, GREEDY)
            return whole, streamed
        finally:
            await engine.close()

    whole, streamed = asyncio.run(run())
    _check(whole, expected)
    _check(streamed, expected)


def test_process_client_sends_the_images(vl_dir, request_inputs, expected):
    ids, mm, _ = request_inputs

    with EngineProcess(EngineConfig(model=str(vl_dir), block_size=8)) as proc:
        out = asyncio.run(proc.client.generate(ids, GREEDY, multimodal=mm))
    _check(out, expected)


def test_remote_client_sends_the_images(vl_dir, request_inputs, expected, tiny_model_factory):
    ids, mm, _ = request_inputs
    server = serve_model(EngineConfig(model=str(vl_dir), block_size=8), "vl")
    text_server = serve_model(EngineConfig(model=str(tiny_model_factory("qwen2")), block_size=4), "text")

    async def run():
        async with RemoteClient(server.url) as client, RemoteClient(text_server.url) as text_client:
            out = await client.generate(ids, GREEDY, multimodal=mm)
            with pytest.raises(InvalidRequestError, match="text-only"):
                await text_client.generate([5, 6, 7], GREEDY, multimodal=mm)
            pool = client.pool("generate")
            bad = await pool.post(server.url + "/inflight/v1/generate",
                                  json={"prompt_token_ids": ids, "multimodal": {"tensors": "not base64!"}})
            return out, bad

    try:
        out, bad = asyncio.run(run())
    finally:
        server.stop()
        text_server.stop()
    _check(out, expected)
    assert bad.status_code == 400 and "multimodal" in bad.text
