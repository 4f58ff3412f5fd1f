"""A handful of SkyRL's own launch scripts run to completion here, for real: their overrides with
devices and paths pointed at this machine (as the validation test does), sizes shrunk to a tiny model
and a few steps, on the backends they name (vLLM engines, FSDP, gloo for SkyRL's nccl). Chosen across
algorithms (PPO with a critic and GAE; rollout importance sampling with geometric masks) and
placements (colocated synchronous, fully async)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(400)]

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "config"))
from test_skyrl_recipes import RECIPES, localize  # noqa: E402

SHRINK = [
    "trainer.train_batch_size=2", "trainer.policy_mini_batch_size=2", "trainer.critic_mini_batch_size=2",
    "trainer.micro_train_batch_size_per_gpu=4", "trainer.micro_forward_batch_size_per_gpu=4",
    "generator.n_samples_per_prompt=2", "trainer.max_training_steps=2", "trainer.max_prompt_length=200",
    "generator.sampling_params.max_generate_length=8", "generator.eval_sampling_params.max_generate_length=8",
    "trainer.eval_interval=2", "trainer.eval_batch_size=8", "generator.eval_n_samples_per_prompt=1",
    "trainer.logger=console", "job.num_eval=4", "job.progress=false", "job.plot=false",
    "generator.inference_engine.max_num_seqs=16", "generator.inference_engine.max_model_len=256",
]  # fmt: skip
"""Sizes only: a tiny model and a few steps."""
SCRIPTS = {
    "examples/train/ppo/run_ppo.sh": [],
    "examples/train/fully_async/fully_async_run_gsm8k.sh": [
        "trainer.fully_async.num_parallel_generation_workers=2"
    ],
}
"""The scripts, with what their sizes need besides SHRINK (generation workers for 2 prompts). (DAPO's
dynamic sampling needs prompts whose samples differ in reward, which a random tiny model never gives:
its filter then stops the run after max_sample_batches, as SkyRL's does; its pieces are tested apart.)"""


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """A tiny chat model and a GSM8K-style data set in SkyRL's format."""
    import os

    from inflight.bench.vllm_side import default_python
    from inflight.testing import make_tiny_model

    python = default_python()
    if not (Path(python).is_file() and os.access(python, os.X_OK)):
        pytest.skip(f"no vLLM python at {python} (create it with scripts/vllm_venv.sh)")

    root = tmp_path_factory.mktemp("recipes")
    # vLLM CPU attends heads of 32 or more dimensions: 64 wide, 2 heads
    make_tiny_model(
        root / "model", arch="qwen2", max_position_embeddings=256, hidden_size=64, num_attention_heads=2,
        num_key_value_heads=1,
    )
    subprocess.run(
        [
            sys.executable, str(ROOT / "examples" / "gsm8k" / "make_data.py"), "--output-dir",
            str(root / "data"), "--num-train", "40", "--num-test", "8",
        ],
        check=True,
        capture_output=True,
    )
    for split, name in (("train", "train_data"), ("test", "val_data")):
        (root / "data" / f"{name}.parquet").symlink_to(root / "data" / f"{split}.parquet")
    return root


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_a_skyrl_recipe_trains_to_the_end(script, workspace, tmp_path):
    overrides = [*localize(RECIPES[script], workspace), *SHRINK, *SCRIPTS[script],
                 f"job.output_dir={tmp_path / 'run'}", f"trainer.ckpt_path={tmp_path / 'ckpt'}",
                 f"trainer.export_path={tmp_path / 'exports'}", f"trainer.log_path={tmp_path / 'logs'}"]
    proc = subprocess.run([sys.executable, "-m", "inflight.cli", "train", *overrides], capture_output=True,
                          text=True, timeout=380, cwd=tmp_path)
    assert proc.returncode == 0, f"{script}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    steps = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    trained = [s for s in steps if "optimizer_steps" in s]
    assert len(trained) == 2 and all(s["generated_tokens"] > 0 for s in trained)
    assert (tmp_path / "ckpt" / "latest").is_file()  # SkyRL checkpoints at the end of a run
    if "ppo" in script:
        assert all("critic/critic_loss" in s for s in trained)  # PPO: the critic trains beside the policy
