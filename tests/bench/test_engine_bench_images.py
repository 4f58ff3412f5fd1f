"""`inflight bench engine --images` runs end to end on the tiny Qwen2.5-VL and prints its table (no
timing checks): one image per prompt, whose placeholder run is what transformers' image processor
makes of that image; both sides produce the requested tokens; vLLM, where its venv exists, is left
out with the reason it cannot serve the model printed."""

from __future__ import annotations

import json
from pathlib import Path

from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from inflight.bench import vllm_side
from inflight.bench.engine_bench import main
from inflight.bench.engine_images import MAX_SIDE, MIN_SIDE, BenchImage, image_workload
from inflight.bench.engine_workload import BenchConfig
from inflight.testing.tiny_vlm import MAX_PIXELS, MERGE_SIZE, MIN_PIXELS, PATCH_SIZE, make_tiny_vlm


def test_image_bench_prints_the_table(tmp_path, capsys):
    out = tmp_path / "bench.json"
    against = "transformers,vllm" if Path(vllm_side.default_python()).exists() else "transformers"
    argv = (
        "--images --small --requests 3 --min-len 4 --max-len 8 --repeats 1 --max-rounds 1 --hf-batch-sizes 3 "
        f"--threads 1 --allow-noisy --against {against}"
    ).split() + ["--out", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "speedup (engine / transformers output tok/s)" in printed and "CPU: " in printed
    assert "3 images, one per prompt" in printed
    result = json.loads(out.read_text())
    assert result["model"]["model_type"] == "qwen2_5_vl" and result["workload"]["images"] == 3
    assert result["engine"]["output_tokens"] == result["transformers"]["output_tokens"] == \
        result["workload"]["output_tokens"]
    assert len(result["machine"]["load_average"]["start"]) == 3
    if "vllm" in against:
        assert "vllm" not in result and "Qwen2.5-VL" in result["vllm_not_run"]
        assert f"vLLM not run: {result['vllm_not_run']}" in printed


def test_each_prompt_holds_its_image_s_run_as_transformers_counts_it(tmp_path):
    model_dir = make_tiny_vlm(tmp_path / "vl")
    cfg = BenchConfig(images=True, small=True, requests=5, min_len=4, max_len=12, seed=3)
    work = image_workload(cfg, model_dir)
    pad = json.loads((model_dir / "config.json").read_text())["image_token_id"]
    oracle = Qwen2VLImageProcessorPil(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS, patch_size=PATCH_SIZE,
                                      merge_size=MERGE_SIZE, temporal_patch_size=2)
    assert len({(im.width, im.height) for im in work.images}) == 5
    for prompt, image in zip(work.prompts, work.images, strict=True):
        assert isinstance(image, BenchImage) and MIN_SIDE <= min(image.width, image.height) <= MAX_SIDE
        grid = oracle([image.picture()], return_tensors="pt")["image_grid_thw"][0]
        first, count = prompt.index(pad), prompt.count(pad)
        assert count == int(grid.prod()) // MERGE_SIZE**2
        assert prompt[first:first + count] == [pad] * count  # one run
    assert image_workload(cfg, model_dir).prompts == work.prompts  # seeded
