"""Train the Agents SDK agent of `weather_agent.py` on a model of yours (see README "Train your agent").

    python examples/agent/train_agent.py --model /path/to/Qwen2.5-0.5B-Instruct [key=value ...]
    python examples/agent/train_agent.py --tiny      # a tiny random model built here: checks the wiring

It writes its data (`data/train.jsonl`: "what is the weather in <city>?" rows, no download), puts
this folder on the import path (`generator.agent.path=weather_agent:agent`) and runs `inflight train`
with `agent.yaml`; more `key=value` overrides go to the run.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
CITIES = ["Paris", "Rome", "Oslo", "Lima"]


def write_data(path: Path, rows: int = 64) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for i in range(rows):
            city = CITIES[i % len(CITIES)]
            f.write(json.dumps({"id": f"weather-{i}", "prompt": f"What is the weather in {city} today?",
                                "answer": city}) + "\n")
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a Hugging Face model directory")
    parser.add_argument("--tiny", action="store_true", help="build a tiny random model and run two steps")
    parser.add_argument("--data-only", action="store_true", help="write the data and stop")
    parser.add_argument("--output", default="runs/agent", help="the run's output directory")
    parser.add_argument("overrides", nargs="*", help="more config overrides (key=value)")
    args = parser.parse_args(argv)
    data = write_data(HERE / "data" / "train.jsonl")
    if args.data_only:
        return 0
    sys.path.insert(0, str(HERE))  # generator.agent.path=weather_agent:agent
    overrides = [f"data.train_data=['{data}']", f"job.output_dir={args.output}", *args.overrides]
    if args.tiny:
        from inflight.testing import make_tiny_model

        model = Path(args.output) / "tiny_model"
        make_tiny_model(model, "qwen2")
        overrides = [f"trainer.policy.model.path={model}", "trainer.max_training_steps=2",
                     "trainer.train_batch_size=2",
                     "trainer.policy_mini_batch_size=2", "generator.n_samples_per_prompt=2",
                     "trainer.fully_async.num_parallel_generation_workers=4",
                     "generator.sampling_params.max_generate_length=16",
                     "generator.inference_engine.max_model_len=1024",
                     "trainer.logger=[console]", "job.plot=false", *overrides]
    elif args.model:
        overrides = [f"trainer.policy.model.path={args.model}", *overrides]
    else:
        parser.error("give --model DIR (or --tiny)")
    from inflight.train.main import main as train

    return train(["--config", str(HERE / "agent.yaml"), *overrides])


if __name__ == "__main__":
    sys.exit(main())
