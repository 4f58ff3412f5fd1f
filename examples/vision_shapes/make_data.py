"""Write the vision-shapes recipe's images, data and warmed-up tiny vision-language model, locally.

    python examples/vision_shapes/make_data.py [--output-dir examples/vision_shapes/data]
        [--num-train 3000] [--num-test 200] [--warmup-steps 14] [--warmup-max-seconds 300] [--question count]

Each row shows one shape (a circle, a square or a triangle) in one of four colours, at a random place
and size on a noisy grey background, in an image of one of several sizes (56x56 to 112x112 pixels:
4 to 16 image tokens), and asks "What colour is the shape?"; the answer is the colour's name, scored
by the `exact` reward (`--question count`: one to four shapes, "How many shapes are there?", a
harder task on which this model learns slowly). The images are PNG files drawn here with PIL
(<output-dir>/images); the rows are SkyRL's multimodal rows (an image part naming its file relative
to the data file, a text part), written with the `datasets` library as <output-dir>/train.parquet
and <output-dir>/test.parquet (disjoint images, the same for the same --seed).

The model (<output-dir>/model) is `inflight.testing.tiny_vlm`'s Qwen2.5-VL shape with a wider
language model (128 x 4 layers), built with random weights and warmed up by a supervised phase of
--warmup-steps steps on the training rows (`inflight.tasks.warm_up`): the steps are its budget, so
every machine starts RL from the same model; --warmup-max-seconds only caps a machine too slow for
them, and says so. The warm-up's 14 steps leave it right on about half of the held-out images
(56.5% on an AMD EPYC Zen 3; chance is a quarter, and 20 steps make it near perfect): RL has room.
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

import datasets
import numpy as np
from PIL import Image, ImageDraw

COLOURS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (50, 80, 220), "yellow": (230, 210, 40)}
SHAPES = ("circle", "square", "triangle")
SIZES = ((56, 56), (84, 84), (112, 84), (84, 112), (112, 112))
"""Image sizes (width, height) in pixels: multiples of the 28-pixel merged patch."""
TEXT_MODEL = dict(hidden_size=128, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2,  # heads of 32: M-RoPE's (temporal, height, width) share 4 + 6 + 6
                  rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[4, 6, 6]))
"""The language model of the recipe's tiny Qwen2.5-VL (`make_tiny_vlm`'s text overrides)."""


def draw(rng: random.Random, colours: list[str], size: tuple[int, int]) -> Image.Image:
    """A shape of a random kind in each of `colours`, each in its own quarter of the image (none
    overlap), on a noisy grey background."""
    width, height = size
    noise = np.random.RandomState(rng.randrange(2**31)).randint(100, 156, (height, width, 3), dtype=np.uint8)
    image = Image.fromarray(noise)
    pen, cell_w, cell_h = ImageDraw.Draw(image), width // 2, height // 2
    for cell, colour in zip(rng.sample(range(4), len(colours)), colours, strict=True):
        side = rng.randint(min(cell_w, cell_h) // 2, min(cell_w, cell_h) - 2)
        x = (cell % 2) * cell_w + rng.randint(0, cell_w - side)
        y = (cell // 2) * cell_h + rng.randint(0, cell_h - side)
        shape, fill = rng.choice(SHAPES), COLOURS[colour]
        if shape == "circle":
            pen.ellipse((x, y, x + side, y + side), fill=fill)
        elif shape == "square":
            pen.rectangle((x, y, x + side, y + side), fill=fill)
        else:
            pen.polygon([(x + side // 2, y), (x, y + side), (x + side, y + side)], fill=fill)
    return image


def question(rng: random.Random, kind: str) -> tuple[list[str], str, str]:
    """(the shapes' colours, the question, its answer) of a `kind` question: `colour` (one shape)
    or `count` (one to four shapes)."""
    if kind == "colour":
        colour = rng.choice(list(COLOURS))
        return [colour], "What colour is the shape?", colour
    colours = [rng.choice(list(COLOURS)) for _ in range(rng.randint(1, 4))]
    return colours, "How many shapes are there?", str(len(colours))


def rows(rng: random.Random, count: int, split: str, output_dir: Path, kind: str = "colour") -> list[dict]:
    """`count` SkyRL rows of `split` asking `kind` questions, their images under output_dir/images."""
    images = output_dir / "images"
    images.mkdir(parents=True, exist_ok=True)
    out = []
    for i in range(count):
        (colours, text, answer), size = question(rng, kind), rng.choice(SIZES)
        name = f"images/{split}-{i:05d}.png"
        draw(rng, colours, size).save(output_dir / name)
        content = [{"type": "image", "image": name, "text": None},
                   {"type": "text", "image": None, "text": text}]
        out.append({"data_source": f"vision_shapes_{kind}", "prompt": [{"role": "user", "content": content}],
                    "env_class": "exact", "reward_spec": {"method": "rule", "ground_truth": answer},
                    "extra_info": {"split": split, "index": i, "width": size[0], "height": size[1]}})
    return out


def write_data(output_dir: Path, num_train: int, num_test: int, seed: int = 0, kind: str = "colour"
               ) -> dict[str, Path]:
    """Write the images, train.parquet and test.parquet under `output_dir`; their paths by split."""
    rng = random.Random(seed)
    paths = {}
    for split, count in (("train", num_train), ("test", num_test)):
        paths[split] = output_dir / f"{split}.parquet"
        datasets.Dataset.from_list(rows(rng, count, split, output_dir, kind)).to_parquet(str(paths[split]))
    return paths


def build_model(model_dir: Path, paths: dict[str, Path], steps: int, max_seconds: float | None, seed: int = 0,
                log=print):
    """Build the tiny Qwen2.5-VL in `model_dir` and warm it up on the training rows for `steps`
    steps (`max_seconds` caps it); returns the warm-up's report."""
    from transformers import AutoTokenizer

    from inflight.chat.vision import load_vision
    from inflight.tasks import warm_up
    from inflight.tasks.data_task import DataTask
    from inflight.testing.tiny_vlm import make_tiny_vlm

    make_tiny_vlm(model_dir, seed=seed, **TEXT_MODEL)
    task = DataTask(AutoTokenizer.from_pretrained(model_dir), [str(paths["train"])], [str(paths["test"])],
                    env_class="exact", vision=load_vision(model_dir), seed=seed)
    return warm_up(model_dir, task, steps=steps, batch_size=64, lr=3e-3, max_seconds=max_seconds,
                   eval_every=10, seed=seed, log=log, threads=0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output-dir", type=Path, default=Path(__file__).parent / "data")
    parser.add_argument("--num-train", type=int, default=3000)
    parser.add_argument("--num-test", type=int, default=200)
    parser.add_argument("--warmup-steps", type=int, default=14, help="the supervised warm-up's budget")
    parser.add_argument("--warmup-max-seconds", type=float, default=300.0, help="a cap only (0: none)")
    parser.add_argument("--question", choices=("colour", "count"), default="colour",
                        help="what the rows ask: the shape's colour, or how many shapes there are")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    started = time.perf_counter()
    paths = write_data(args.output_dir, args.num_train, args.num_test, args.seed, args.question)
    print(f"wrote {paths['train']} ({args.num_train} rows) and {paths['test']} ({args.num_test} rows)")
    report = build_model(args.output_dir / "model", paths, args.warmup_steps, args.warmup_max_seconds or None,
                         args.seed)
    print(f"model: {args.output_dir / 'model'}; warm-up {report.steps} steps in {report.seconds:.0f} s, "
          f"held-out teacher-forced accuracy {report.accuracy:.1%} (stopped by {report.stopped_by}); "
          f"total {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
