"""Write the SmolLM2 recipe's data set in SkyRL's format, locally (no download).

    python examples/smollm2/make_data.py [--output-dir examples/smollm2/data] [--num-train 4000] \
        [--num-test 200]

Each row asks for the sum of two numbers from 1 to 50 ("What is 17 + 8?"), one user message, scored by
`gsm8k_flexible` (the last number in the response, compared numerically). SmolLM2-135M-Instruct as
shipped often states the right sum and then keeps talking, so the last number it writes is another
one ("17 + 8 = 25. This adds 17 and 8."), or it runs out of tokens mid-explanation: greedy, it scores
~17-25%. That is a weak start that RL can move within minutes: answering with the sum last, and
briefly. Written with the `datasets` library as Parquet: <output-dir>/train.parquet and
<output-dir>/test.parquet, disjoint, the same for the same --seed.
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

import datasets

LOW, HIGH = 1, 50


def rows(pairs: list[tuple[int, int]], split: str) -> list[dict]:
    """SkyRL rows asking for each pair's sum."""
    return [
        {
            "data_source": "smollm2_addition",
            "prompt": [{"role": "user", "content": f"What is {a} + {b}?"}],
            "env_class": "gsm8k_flexible",
            "reward_spec": {"method": "rule", "ground_truth": str(a + b)},
            "extra_info": {"split": split, "index": i, "a": a, "b": b},
        }
        for i, (a, b) in enumerate(pairs)
    ]


def write(output_dir: Path, num_train: int, num_test: int, seed: int = 0) -> dict[str, Path]:
    """Write train.parquet and test.parquet under `output_dir` (the test pairs never in train; train
    pairs repeat when `num_train` exceeds the pairs left); returns their paths by split."""
    pairs = [(a, b) for a in range(LOW, HIGH + 1) for b in range(LOW, HIGH + 1)]
    if num_test >= len(pairs):
        raise ValueError(f"--num-test {num_test} leaves no pair to train on (there are {len(pairs)})")
    rng = random.Random(seed)
    rng.shuffle(pairs)
    test, train_pool = pairs[:num_test], pairs[num_test:]
    train = [train_pool[i % len(train_pool)] for i in range(num_train)]
    rng.shuffle(train)
    output_dir.mkdir(parents=True, exist_ok=True)
    paths = {}
    for split, chosen in (("train", train), ("test", test)):
        paths[split] = output_dir / f"{split}.parquet"
        datasets.Dataset.from_list(rows(chosen, split)).to_parquet(str(paths[split]))
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output-dir", type=Path, default=Path(__file__).parent / "data")
    parser.add_argument("--num-train", type=int, default=4000)
    parser.add_argument("--num-test", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    for split, path in write(args.output_dir, args.num_train, args.num_test, args.seed).items():
        print(f"{split}: {path}")


if __name__ == "__main__":
    main()
