"""A tiny mixture of experts trained end to end, fully async with routing replay: the engines record
the routing of every rollout, the trainer replays it, and the built-in addition task's greedy
accuracy rises. The built-in base model's architecture is `job.arch`."""

from __future__ import annotations

import asyncio

import pytest
from rl_support import SMALL_MODEL, rl_config

from inflight.config.job import JobConfig, split_job_config
from inflight.tasks import AdditionTask, build_base_model, warm_up
from inflight.tasks.base_model import ARCHS
from inflight.train.trainer import make_trainer

REPLAY = ("trainer.policy.megatron_config.moe_enable_routing_replay=true",
          "generator.inference_engine.enable_return_routed_experts=true")


class TrainedAndHeldOut(AdditionTask):
    """One-digit addition evaluated on its training pairs (what 100 steps can move) and held-out ones."""

    def eval_sets(self) -> dict[str, list]:
        return {"trained": list({p.prompt: p for p in self.train_problems()}.values()),
                "held_out": list(self.eval_problems())}


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    """A small Qwen3-MoE (8 experts of 64, 2 per token) warmed up to about 10% held-out accuracy
    (about 60% on the pairs it trains on: room to improve either way)."""
    path = build_base_model(tmp_path_factory.mktemp("moe-base"), seed=0, arch="qwen3_moe",
                            moe_intermediate_size=64, **SMALL_MODEL)
    warm_up(path, AdditionTask(max_digits=1, num_eval=20, num_train=400), steps=400, batch_size=64,
            max_seconds=60, target_accuracy=0.1, eval_every=10, seed=0)
    return path


def test_a_tiny_moe_learns_fully_async_with_routing_replay(moe_dir, tmp_path):
    cfg, job = rl_config(moe_dir, tmp_path, [
        *REPLAY, "trainer.train_batch_size=16", "trainer.policy_mini_batch_size=16",
        "generator.n_samples_per_prompt=8", "trainer.fully_async.num_parallel_generation_workers=32",
        "trainer.epochs=30", "job.max_steps=100", "trainer.eval_interval=0",
        "trainer.moe_logprob_gap_interval=10", "trainer.policy.optimizer_config.lr=2e-4",
        "generator.eval_sampling_params.temperature=0",
        "generator.eval_sampling_params.max_generate_length=8"])  # fmt: skip
    task = TrainedAndHeldOut(max_digits=1, num_eval=20, num_train=400)

    async def main():
        trainer = make_trainer(cfg, job, task)
        try:
            await trainer.setup()
            before = await trainer.evaluate()
            history = await trainer.train()
            return trainer, history, before, await trainer.evaluate()
        finally:
            await trainer.close()

    trainer, history, before, after = asyncio.run(main())
    assert trainer.mode == "fully_async" and len(history) == 100
    assert max(r["staleness_max"] for r in history) >= 1  # generation ran ahead of training
    trained = [r for r in history if r.get("optimizer_steps")]
    assert trained and all(r["moe/routing_mismatch"] == 0.0 for r in trained)  # every token replayed
    assert all(r["moe/routed_tokens"] > 0 for r in trained)
    gaps = [r for r in history if "moe/logprob_gap_replay" in r]
    assert [r["step"] for r in gaps] == list(range(1, 101, 10))
    # step 1's rollouts are the trainer's own weights' (version 0): the engine's log-probabilities, either way
    assert gaps[0]["moe/logprob_gap_replay"] < 1e-5 and gaps[0]["moe/logprob_gap_no_replay"] < 1e-5
    trained_pairs = "eval/trained/pass@1"  # 100 steps: about +0.1 to +0.15 (0.59 -> 0.70-0.75 in 3 runs)
    assert after["metrics"][trained_pairs] >= before["metrics"][trained_pairs] + 0.05, (before, after)


def test_job_arch_builds_the_base_model_of_that_architecture(tmp_path):
    from transformers import AutoConfig

    from inflight.config import load_config
    from inflight.testing import LOCAL_CPU
    from inflight.train.main import prepare_base_model

    assert JobConfig.__dataclass_fields__["arch"].default == "qwen2"
    for arch in ARCHS:
        job, _, _ = split_job_config(
            {
                "job": {
                    "arch": arch, "output_dir": str(tmp_path / arch), "warmup_steps": 1,
                    "warmup_batch_size": 2,
                }
            },
            [],
        )
        cfg = load_config(None, list(LOCAL_CPU))
        prepare_base_model(cfg, job, AdditionTask(max_digits=1, num_eval=2, num_train=10), lambda _: None)
        assert AutoConfig.from_pretrained(cfg.trainer.policy.model.path).model_type == arch
    with pytest.raises(Exception, match="job.arch"):
        split_job_config({"job": {"arch": "mixtral"}}, [])
