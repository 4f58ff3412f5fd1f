"""The training step pays for little padding and computes what it did fully padded: each
micro-batch is as wide as its own longest row, and the update, the metrics and the proximal and
reference log-probabilities equal those of the unsorted step padded to its longest row, for the
loss reductions, on- and off-policy, with and without KL."""

from __future__ import annotations

import pytest
import torch
from rl_support import rl_config, warm_model_dir

from inflight.rollout.task_generator import Trajectory, TrajectoryGroup
from inflight.tasks import Problem
from inflight.train import LocalPolicyWorker
from inflight.train import step as step_module
from inflight.train.data_parallel import DataParallel, MicroPlan, padding, shard_step
from inflight.train.step import StepOptions, TrainingStep, build_batch, shard_logprobs

COMPARED = (
    "loss", "clip_ratio", "kl", "is_ratio_mean", "is_ratio_max", "is_ratio_min", "tis_token_clip_high_ratio",
    "trained_tokens", "optimizer_steps",
)
SIZES = ("trainer.train_batch_size=4", "trainer.policy_mini_batch_size=4",
         "trainer.fully_async.num_parallel_generation_workers=8", "trainer.algorithm.max_seq_len=40")
REGIMES = {
    "on-policy": (0, []),
    "stale-in-forward-tis": (1, []),  # one optimizer step: TIS against the training forward itself
    # 2 mini-batches x 2 epochs: an old-log-probability forward for the TIS weights, a reference for the KL
    "stale-proximal-kl": (1, ["trainer.update_epochs_per_batch=2", "trainer.policy_mini_batch_size=2",
                              "trainer.fully_async.enabled=false",
                              "trainer.algorithm.use_kl_loss=true", "trainer.algorithm.kl_loss_coef=0.5"]),
}
REDUCTIONS = ("token_mean", "sequence_mean", "seq_mean_token_sum_norm", "prompt_mean")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return warm_model_dir(tmp_path_factory)


def summation_order_tolerance(terms: int, dtype: torch.dtype = torch.float32) -> float:
    """Relative tolerance between two float32 sums of the same `terms` same-sign values added in
    different orders (micro-batches and BLAS kernels, AVX-512 or AVX2, each pick their own): each
    differs from the exact sum by at most (terms - 1) * eps relative (Higham, recursive summation),
    so two differ by at most twice that. A lost or doubled row moves a metric by ~1/rows instead."""
    return 2 * (terms - 1) * torch.finfo(dtype).eps


def long_tail_groups(version: int, num_groups: int = 4, seed: int = 3) -> list[TrajectoryGroup]:
    """Groups of 4 with response lengths from a long tail (most 1-3 tokens, a few 12-24)."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([1, 1, 2, 2, 3, 3, 5, 12, 24])
    groups = []
    for g in range(num_groups):
        trajs = []
        for r in (1.0, 0.0, 0.0, 1.0):
            n = int(lengths[torch.randint(len(lengths), (1,), generator=gen)])
            ids = torch.randint(2, 14, (n,), generator=gen).tolist()
            trajs.append(Trajectory([5, 12, 7, 13], ids, (-torch.rand(n, generator=gen) - 0.5).tolist(),
                                    [version] * n, [1] * n, r, "stop"))
        groups.append(TrajectoryGroup(Problem(f"p{g}", "3+5=", "8"), trajs))
    return groups


def fully_padded(batch, mini):
    """The step before length-aware micro-batches (with `micro` >= the rows): the mini-batch's
    rows in their order, padded to the step's longest row, in one pass."""
    rows = torch.arange(mini.local.start, mini.local.stop)
    return [(batch.select(rows), rows)] + [(padding(batch), None)] * (mini.micro_batches - 1)


def run_step(model_dir, tmp_path, overrides, version, micro, options, monkeypatch=None, groups=None) -> dict:
    """One step with plain SGD (so parameters compare to 1e-5); the updated state, the metrics and
    the [rows, width] of every forward/backward."""
    cfg, _ = rl_config(
        model_dir, tmp_path, [*SIZES, f"trainer.micro_train_batch_size_per_gpu={micro}", *overrides]
    )
    worker = LocalPolicyWorker(cfg).setup()
    worker.optimizer = torch.optim.SGD([p for p in worker.model.parameters() if p.requires_grad], lr=0.5)
    reference = None
    if cfg.trainer.algorithm.use_kl_loss:
        reference = LocalPolicyWorker(cfg)
        reference.build_model()
    if monkeypatch is not None:
        monkeypatch.setattr(step_module, "micro_batches", fully_padded)
    shapes, original = [], worker.forward_backward

    def spy(part, scale):
        shapes.append((part.widths().tolist(), part.input_ids.shape[1], part.loss_mask.sum() > 0))
        return original(part, scale)

    worker.forward_backward = spy
    initial = worker.full_hf_state_dict()
    step = TrainingStep(worker, cfg, 0, options, reference)
    metrics = step(groups or long_tail_groups(0), version)
    if monkeypatch is not None:
        monkeypatch.undo()
    return {
        "state": worker.full_hf_state_dict(), "initial": initial, "metrics": metrics, "shapes": shapes,
        "counts": step.counts,
    }


def test_each_micro_batch_is_padded_to_its_own_longest_row(model_dir, tmp_path):
    out = run_step(model_dir, tmp_path, [], 0, 4, StepOptions(shared_prefix_forward=False))
    real_parts = [(widths, width) for widths, width, real in out["shapes"] if real]
    assert len(real_parts) >= 3
    for widths, width in real_parts:
        assert width == max(widths)
    padded = sum(len(widths) * width for widths, width in real_parts)
    real = sum(sum(widths) for widths, _ in real_parts)
    longest = max(w for widths, _ in real_parts for w in widths)
    assert padded < 1.3 * real < 0.6 * longest * sum(len(widths) for widths, _ in real_parts)
    assert out["metrics"]["train_padded_tokens"] == padded and out["metrics"]["train_real_tokens"] == real


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("regime", list(REGIMES))
def test_the_update_equals_the_fully_padded_one(model_dir, tmp_path, monkeypatch, regime, reduction):
    version, overrides = REGIMES[regime]
    overrides = [*overrides, f"trainer.algorithm.loss_reduction={reduction}"]
    want = run_step(
        model_dir, tmp_path, overrides, version, 64, StepOptions(shared_prefix_forward=False), monkeypatch
    )
    # every distinct length its own micro-batch, at most 3 rows, at most 30 padded tokens
    options = StepOptions(
        max_tokens_per_micro_batch=30, micro_batch_pass_tokens=0.0, shared_prefix_forward=False
    )
    got = run_step(model_dir, tmp_path, overrides, version, 3, options)
    assert len(got["shapes"]) > 2 * len(want["shapes"])
    assert_same_update(got, want, overrides)


def assert_same_update(got: dict, want: dict, overrides: list[str]) -> None:
    """`got`'s updated state and metrics equal `want`'s within float32 summation order, for fewer
    tokens run. Each parameter's update is compared relative to its own size: the two steps sum the
    same terms in other orders (micro-batches, and each CPU's BLAS blocking), which moves an update by
    a few 1e-4 of its size after four optimizer steps (measured on AVX2 and AVX-512); a row lost or
    counted twice moves it by ~1/rows (several percent)."""
    passes = "trainer.update_epochs_per_batch=2" in overrides
    # later passes run on weights the first moved, so they inherit its differences
    update_rtol = 5e-3 if passes else 1e-3
    for key, tensor in want["state"].items():
        size = float((tensor - want["initial"][key]).abs().max())
        off = float((got["state"][key] - tensor).abs().max())
        assert off <= update_rtol * size + 1e-7, (
            f"{key}: off by {off:.3g}, {off / max(size, 1e-30):.2g} of the update"
        )
    rel = summation_order_tolerance(int(want["metrics"]["trained_tokens"]))
    # after a first optimizer step the weights agree to a few 1e-4 of the update, and the later
    # passes' metrics inherit it: 1.2e-4 relative on the loss, measured on AVX2
    atol = 1e-4 if passes else 1e-5
    rel = max(rel, 1e-3) if passes else rel
    for key in COMPARED:
        assert (key in got["metrics"]) == (key in want["metrics"]), key
        if key in want["metrics"]:
            assert got["metrics"][key] == pytest.approx(want["metrics"][key], rel=rel, abs=atol), key
    assert got["metrics"]["train_padded_tokens"] < 0.7 * want["metrics"]["train_padded_tokens"]


def test_logprobs_come_back_to_their_rows(model_dir, tmp_path):
    cfg, _ = rl_config(model_dir, tmp_path, list(SIZES))
    worker = LocalPolicyWorker(cfg).setup()
    groups = long_tail_groups(0, num_groups=3)
    batch = build_batch(groups, None, 0)
    shard = shard_step(3, 4, 3, MicroPlan(2, pass_cost=0.0), DataParallel(), batch.widths().tolist())
    got, want = shard_logprobs(worker, batch, shard), worker.logprobs(batch)
    attention = batch.attention_mask.bool()
    torch.testing.assert_close(got[attention], want[attention], atol=1e-5, rtol=0)
    assert (got[~attention] == 0).all()


def distinct_prompt_groups() -> list[TrajectoryGroup]:
    """`long_tail_groups` with a prompt of its own per group (two share their first tokens)."""
    groups = long_tail_groups(0)
    for g, group in enumerate(groups):
        for traj in group.trajectories:
            traj.prompt_ids = [5, 12, 7, 13, 2 + min(g, 2)] + [3] * g
    return groups


@pytest.mark.parametrize("reduction", ["token_mean", "seq_mean_token_sum_norm"])
@pytest.mark.parametrize("regime", list(REGIMES))
def test_the_shared_prefix_update_equals_the_fully_padded_one(
    model_dir, tmp_path, monkeypatch, regime, reduction
):
    """`trainer.shared_prefix_forward`: micro-batches of whole groups, each group one packed row;
    the update, the metrics and the proximal and reference forwards as fully padded."""
    version, overrides = REGIMES[regime]
    overrides = [*overrides, f"trainer.algorithm.loss_reduction={reduction}"]
    want = run_step(
        model_dir, tmp_path, overrides, version, 64, StepOptions(shared_prefix_forward=False), monkeypatch,
        groups=distinct_prompt_groups(),
    )
    shared = [*overrides, "trainer.shared_prefix_forward=true"]
    got = run_step(model_dir, tmp_path, shared, version, 8, StepOptions(micro_batch_pass_tokens=0.0,
                                                                          shared_prefix_forward=True),
                   groups=distinct_prompt_groups())
    assert_same_update(got, want, overrides)
    # whole groups per micro-batch (at most 8 rows: two groups), each run as packed rows
    for widths, _, real in got["shapes"]:
        assert not real or len(widths) in (4, 8)
