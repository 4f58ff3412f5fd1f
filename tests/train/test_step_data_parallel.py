"""The training step split over data-parallel ranks: which rows each rank trains on
(`shard_step`, no processes), and 2 FSDP ranks (spawned, gloo) against one unsharded worker on the
whole batch: the same updated parameters (the critic's too) and metrics, each rank training on its
own rows only, and no hang when the shares are uneven (dp_step_session.py holds the scenarios)."""

from __future__ import annotations

import socket
import time

import pytest
import torch
import torch.multiprocessing as mp
from dp_step_session import COMPARED_METRICS, SCENARIOS, run_rank, run_scenario
from rl_support import warm_model_dir

from inflight.train import LocalPolicyWorker
from inflight.train import data_parallel as dp_module
from inflight.train.critic import LocalCriticWorker
from inflight.train.data_parallel import DataParallel, StepStats, data_parallel, shard_step

SPAWN_TIMEOUT_S = 600


def test_groups_are_dealt_round_robin_per_mini_batch():
    # 5 groups of 2 rows, mini-batches of 3 groups, micro-batches of 2 rows, 2 ranks
    r0 = shard_step(5, 2, 3, 2, DataParallel(0, 2))
    r1 = shard_step(5, 2, 3, 2, DataParallel(1, 2))
    assert r0.rows == [0, 1, 4, 5, 6, 7] and r1.rows == [2, 3, 8, 9]
    assert [m.rows for m in r0.mini_batches] == [slice(0, 6), slice(6, 10)]
    assert [(m.local, m.micro_batches) for m in r0.mini_batches] == [(slice(0, 4), 2), (slice(4, 6), 1)]
    assert [(m.local, m.micro_batches) for m in r1.mini_batches] == [(slice(0, 2), 2), (slice(2, 4), 1)]
    idle = shard_step(1, 4, 1, 3, DataParallel(1, 2))  # one group, two ranks: rank 1 has nothing
    assert idle.rows == [] and [(m.local, m.micro_batches) for m in idle.mini_batches] == [(slice(0, 0), 2)]


def test_tensor_parallel_ranks_share_a_data_parallel_rank(monkeypatch):
    class Worker:  # a Megatron rank before its groups exist: 4 ranks, TP 2
        rank, world_size, tp, device = 3, 4, 2, torch.device("cpu")

    monkeypatch.setattr(dp_module.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dp_module.dist, "get_backend", lambda: "gloo")
    assert data_parallel(Worker()) == DataParallel(1, 2)
    Worker.tp = 4
    assert data_parallel(Worker()) == DataParallel(0, 1)


def test_step_stats_alone_are_unchanged():
    stats = StepStats()
    stats.add({"loss": 2.0, "ratio_max": 1.5, "ratio_min": 0.5}, 0.25)
    stats.add({"loss": 4.0, "ratio_max": 1.2, "ratio_min": 0.7}, 0.75)
    out = stats.reduced(DataParallel(), ("loss", "ratio_max", "ratio_min"))
    assert out.sums == {"loss": 3.5} and out.extremes == {"ratio_max": 1.5, "ratio_min": 0.5}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return warm_model_dir(tmp_path_factory)


def _spawn(model_dir, out, backend: str) -> list[dict]:
    """Both ranks' results by scenario (one spawn runs them all; a hang fails, not blocks)."""
    ctx = mp.spawn(run_rank, args=(_free_port(), str(model_dir), str(out), backend), nprocs=2, join=False)
    deadline = time.monotonic() + SPAWN_TIMEOUT_S
    while not ctx.join(timeout=5):
        if time.monotonic() > deadline:
            for process in ctx.processes:
                process.kill()
            pytest.fail(f"the data-parallel ranks did not finish within {SPAWN_TIMEOUT_S} s (a hang)")
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


@pytest.fixture(scope="module")
def ranks(model_dir, tmp_path_factory):
    return _spawn(model_dir, tmp_path_factory.mktemp("dp-step"), "fsdp")


def _alone(name: str, model_dir, tmp_path) -> dict:
    return run_scenario(
        name, str(model_dir), str(tmp_path), lambda cfg: LocalPolicyWorker(cfg, model_path=model_dir),
        lambda cfg: LocalCriticWorker(cfg, model_path=model_dir),
    )


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_two_ranks_step_like_one_rank_on_the_whole_batch(ranks, model_dir, tmp_path, name):
    alone = _alone(name, model_dir, tmp_path)
    first, second = ranks[0][name], ranks[1][name]
    assert alone["moved"] > 1e-3  # the step did change the weights
    for key, tensor in first["state"].items():
        torch.testing.assert_close(tensor, alone["state"][key], atol=1e-5, rtol=0, msg=key)
    for key, tensor in first["critic_state"].items():
        torch.testing.assert_close(tensor, alone["critic_state"][key], atol=1e-5, rtol=0, msg=f"critic {key}")
    for key in COMPARED_METRICS:  # rank 0 reports the metrics of the whole step
        assert (key in first["metrics"]) == (key in alone["metrics"]), key
        if key in alone["metrics"]:
            assert first["metrics"][key] == pytest.approx(alone["metrics"][key], abs=1e-5), key
    # each rank trained on its own rows only, and both ran the same number of passes
    rows = first["trained_rows"], second["trained_rows"]
    assert sum(rows) == alone["trained_rows"] and first["passes"] == second["passes"]
    assert rows[1] == 0 if name == "idle" else 0 < rows[1] < alone["trained_rows"]
    if name == "shared-prefix":  # both ranks ran packed rows: fewer tokens than their rows hold
        assert all(r[name]["padded_tokens"] < r[name]["real_tokens"] for r in ranks)


def test_tensor_parallel_ranks_train_on_the_same_rows(model_dir, tmp_path):
    """Megatron, both ranks one tensor-parallel group: one data-parallel rank, so each trains on
    every row and the step is the one-rank step."""
    pytest.importorskip(
        "megatron.core", reason="megatron-core is not installed: pip install -e '.[megatron]'"
    )
    first, second = (r["uneven"] for r in _spawn(model_dir, tmp_path, "megatron"))
    alone = _alone("uneven", model_dir, tmp_path)
    assert first["trained_rows"] == second["trained_rows"] == alone["trained_rows"]
    for key, tensor in first["state"].items():
        torch.testing.assert_close(tensor, alone["state"][key], atol=1e-5, rtol=0, msg=key)
