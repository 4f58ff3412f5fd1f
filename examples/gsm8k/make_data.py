"""Write a small GSM8K-style data set in SkyRL's format, locally (no download).

    python examples/gsm8k/make_data.py [--output-dir examples/gsm8k/data] [--num-train 2000] [--num-test 200]

Each row is a generated arithmetic word problem whose reference solution ends in `#### <answer>`, in
SkyRL's columns: `data_source`, `prompt` (one user message asking for the answer after `####`),
`env_class` ("gsm8k"), `reward_spec` ({"method": "rule", "ground_truth": "<answer>"}) and `extra_info`
(split, index, question, the worked answer). Written with the `datasets` library as Parquet:
<output-dir>/train.parquet and <output-dir>/test.parquet, disjoint, the same for the same --seed.
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

import datasets

INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
NAMES = ["Ava", "Ben", "Chloe", "Dev", "Emma", "Farid", "Grace", "Hiro", "Ines", "Jon"]
ITEMS = ["apples", "stickers", "marbles", "books", "coins", "pencils", "shells", "cards"]


def word_problem(rng: random.Random) -> tuple[str, str, int]:
    """(question, worked answer ending in `#### n`, n) for one generated problem."""
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    start, more, price = rng.randint(5, 60), rng.randint(2, 30), rng.randint(2, 9)
    kind = rng.randrange(3)
    if kind == 0:
        given = rng.randint(1, start + more - 1)
        total = start + more - given
        question = (
            f"{name} has {start} {item}. {name} gets {more} more and then gives away {given}. "
            f"How many {item} does {name} have now?"
        )
        steps = f"{start} + {more} = {start + more}. {start + more} - {given} = {total}."
    elif kind == 1:
        total = start * price
        question = f"{name} buys {start} {item} at ${price} each. How many dollars does {name} spend?"
        steps = f"{start} * {price} = {total}."
    else:
        boxes = rng.randint(2, 9)
        total = boxes * more + start
        question = (
            f"{name} has {boxes} boxes of {more} {item} and {start} loose {item}. "
            f"How many {item} does {name} have in all?"
        )
        steps = f"{boxes} * {more} = {boxes * more}. {boxes * more} + {start} = {total}."
    return question, f"{steps}\n#### {total}", total


def rows(n: int, split: str, rng: random.Random, seen: set[str]) -> list[dict]:
    """`n` distinct problems (none in `seen`, which they are added to) as SkyRL rows."""
    out: list[dict] = []
    while len(out) < n:
        question, answer, total = word_problem(rng)
        if question in seen:
            continue
        seen.add(question)
        out.append(
            {
                "data_source": "synthetic_gsm8k",
                "prompt": [{"role": "user", "content": f"{question} {INSTRUCTION}"}],
                "env_class": "gsm8k",
                "reward_spec": {"method": "rule", "ground_truth": str(total)},
                "extra_info": {"split": split, "index": len(out), "question": question, "answer": answer},
            }
        )
    return out


def write(output_dir: Path, num_train: int, num_test: int, seed: int = 0) -> dict[str, Path]:
    """Write train.parquet and test.parquet under `output_dir`; returns their paths by split."""
    rng, seen = random.Random(seed), set()
    output_dir.mkdir(parents=True, exist_ok=True)
    paths = {}
    for split, n in (("train", num_train), ("test", num_test)):
        paths[split] = output_dir / f"{split}.parquet"
        datasets.Dataset.from_list(rows(n, split, rng, seen)).to_parquet(str(paths[split]))
    return paths


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output-dir", type=Path, default=Path(__file__).resolve().parent / "data")
    parser.add_argument("--num-train", type=int, default=2000)
    parser.add_argument("--num-test", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    for split, path in write(args.output_dir, args.num_train, args.num_test, args.seed).items():
        print(f"{split}: {path}")


if __name__ == "__main__":
    main()
