"""docs/training/metrics.md documents every key a run logs: short real runs of the trainers (fully async
with held-out evaluations; synchronous with a critic, the KL and entropy terms, CISPO and every
off-policy mask; the KL in the reward with the importance-sampling loss) and the agent generator's
own metrics, each key looked up on the page. The page's placeholders (`eval/<set>/pass@<k>`) stand
for one path segment each."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import pytest
from rl_support import rl_config, small_task, warm_model_dir

from inflight.agents.agent_generator import AgentGenerator
from inflight.rollout.trajectory import Trajectory, TrajectoryGroup
from inflight.tasks.base import Problem
from inflight.train.trainer import make_trainer

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "training" / "metrics.md"
CORRECTION = "trainer.algorithm.off_policy_correction."
RUNS = {
    "fully_async": ["trainer.eval_interval=2", "job.max_steps=4", "job.lend_threads=true"],
    "sync_critic_cispo_masks": [
        "trainer.fully_async.enabled=false", "job.max_steps=2",
        "trainer.algorithm.zero_variance_filter=false",
        "trainer.algorithm.advantage_estimator=gae", "trainer.critic_mini_batch_size=4",
        "trainer.algorithm.use_kl_loss=true", "trainer.algorithm.use_entropy_loss=true",
        "trainer.algorithm.policy_loss_type=cispo",
        f"{CORRECTION}outlier_token_is_threshold_low=0.01",
        f"{CORRECTION}outlier_token_is_threshold_high=100",
        f"{CORRECTION}token_mask_is_threshold_low=0.01", f"{CORRECTION}token_mask_is_threshold_high=100",
        f"{CORRECTION}tis_ratio_type=sequence", f"{CORRECTION}sequence_mask_metric=geometric",
        f"{CORRECTION}geo_mask_low=0.5", f"{CORRECTION}geo_mask_high=2",
    ],
    "kl_in_reward": [
        "job.max_steps=2", "trainer.algorithm.zero_variance_filter=false",
        "trainer.algorithm.use_kl_loss=false",
        "trainer.algorithm.use_kl_in_reward=true", "trainer.algorithm.policy_loss_type=importance_sampling",
        f"{CORRECTION}tis_ratio_type=null",
    ],
}  # fmt: skip


def documented_keys(text: str) -> list[str]:
    """The keys in the `key` column of the page's tables (backticked; several per cell allowed)."""
    keys, column = [], None
    for line in text.splitlines():
        if not line.startswith("|"):
            column = None
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if column is None:
            column = cells.index("key") if "key" in cells else -1
        elif column >= 0 and not set(cells[column]) <= set("- "):
            keys += re.findall(r"`([^`]+)`", cells[column])
    return keys


def pattern(key: str) -> re.Pattern[str]:
    """A documented key as a regex: each `<placeholder>` matches one path segment."""
    parts = re.split(r"<[^>]+>", key)
    return re.compile("[^/]+".join(map(re.escape, parts)) + r"\Z")


def undocumented(logged: set[str], documented: list[str]) -> list[str]:
    patterns = [pattern(k) for k in documented]
    return sorted(k for k in logged if not any(p.match(k) for p in patterns))


@pytest.fixture(scope="module")
def logged(tmp_path_factory) -> dict[str, set[str]]:
    """Every key each run wrote to metrics.jsonl (evaluations before and after included)."""
    model_dir = warm_model_dir(tmp_path_factory)
    out: dict[str, set[str]] = {}
    for name, overrides in RUNS.items():
        run_dir = tmp_path_factory.mktemp(name)
        extra = [f"trainer.critic.model.path={model_dir}"] if "critic" in name else []
        cfg, job = rl_config(model_dir, run_dir, [*overrides, *extra])

        async def run(cfg=cfg, job=job):
            trainer = make_trainer(cfg, job, small_task())
            try:
                await trainer.setup()
                trainer.logger.log(0, (await trainer.evaluate())["metrics"])
                await trainer.train()
            finally:
                await trainer.close()

        asyncio.run(run())
        out[name] = {
            k for line in (run_dir / "metrics.jsonl").read_text().splitlines() for k in json.loads(line)
        }
    return out


def test_the_page_parses_into_keys_and_placeholders():
    keys = documented_keys(PAGE.read_text())
    assert (
        {"reward", "accuracy", "staleness_mean", "throughput/samples_per_s", "eval/<set>/pass@<k>"}
        <= set(keys)
    )
    assert "trainer.correct_threshold" not in keys  # only the key column is read
    assert undocumented({"eval/gsm8k/pass@4", "eval/gsm8k/pass@4/x", "nonsense"}, keys) == [
        "eval/gsm8k/pass@4/x",
        "nonsense",
    ]


@pytest.mark.parametrize("run", list(RUNS))
def test_every_key_a_run_logs_is_on_the_metrics_page(logged, run):
    assert "step" in logged[run] and len(logged[run]) > 40
    missing = undocumented(logged[run] - {"step"}, documented_keys(PAGE.read_text()))
    assert not missing, f"docs/training/metrics.md does not document {missing} (logged by the {run} run)"


def test_the_runs_reach_the_conditional_keys(logged):
    """The runs above really turn on what they are for (else the check would pass vacuously)."""
    assert {"eval/accuracy", "eval/addition/pass@1"} <= logged["fully_async"]
    assert {"critic/critic_loss", "kl", "policy_entropy", "cispo/ratio_mean", "outlier_seq_masked_ratio",
            "token_mask_ratio", "tis_seq_clip_high_ratio", "geo_sequence_mask_masked_ratio"} <= logged[
        "sync_critic_cispo_masks"]
    assert {"avg_kl", "kl_loss_coef", "importance_ratio"} <= logged["kl_in_reward"]


def test_every_agent_metric_is_on_the_metrics_page():
    done = Trajectory(
        prompt_ids=[1, 2],
        response_ids=[3],
        logprobs=[-0.5],
        versions=[0],
        loss_mask=[1],
        reward=1.0,
        finish_reason="stop",
        info={"agent_calls": 2, "agent_samples": 1},
    )
    failed = Trajectory(prompt_ids=[1, 2], response_ids=[4], logprobs=[-0.5], versions=[0], loss_mask=[1],
                        reward=0.0, finish_reason="stop", info={"agent_calls": 1})
    failed.mark_rollout_failed("agent: ValueError: boom")
    group = TrajectoryGroup(Problem("p0", "2+2?", "4"), [done, failed])
    metrics = AgentGenerator.metrics([group])
    assert metrics["agent/episodes_failed"] == 1.0
    assert not undocumented(set(metrics), documented_keys(PAGE.read_text()))
