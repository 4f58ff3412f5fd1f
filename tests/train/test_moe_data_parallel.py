"""Routing replay over 2 FSDP ranks (spawned, gloo): each rank's micro-batches, padding passes
included, run exactly the experts their rows' records hold at every MoE block, and the step's
routing metrics, reduced over the ranks, equal one unsharded worker's on the whole batch. The
trainer's routers differ from the rollout's (a router-only change), so replay is what makes them
run the rollout's experts."""

from __future__ import annotations

import pickle
import socket
import time

import pytest
import torch
import torch.multiprocessing as mp
from moe_dp_session import config, run_rank, watch_experts
from transformers import AutoModelForCausalLM

from inflight.engine import EngineConfig, LLMEngine, SamplingParams
from inflight.rollout.trajectory import Trajectory, TrajectoryGroup
from inflight.tasks.base import Problem
from inflight.testing import make_tiny_model
from inflight.train.moe_replay import moe_routers
from inflight.train.step import TrainingStep
from inflight.train.workers.local import LocalPolicyWorker

SPAWN_TIMEOUT_S = 300
PROMPTS = [[5, 9, 200, 31], list(range(40, 52)), [7, 3], [(13 * i) % 370 + 3 for i in range(17)]]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(rollout model's groups, the trainer's model dir: its routers moved), pickled groups file."""
    root = tmp_path_factory.mktemp("moe-dp")
    rollout_dir = make_tiny_model(root / "rollout", "qwen2_moe", num_hidden_layers=2)
    engine = LLMEngine(EngineConfig(model=str(rollout_dir), block_size=4))
    groups = []
    for i, prompt in enumerate(PROMPTS):
        outs = [
            engine.generate(
                [prompt],
                SamplingParams(
                    max_tokens=3 + 4 * s, temperature=1.0, seed=i * 10 + s, ignore_eos=True,
                    return_routed_experts=True,
                ),
            )[0]
            for s in range(2)
        ]
        groups.append(TrajectoryGroup(Problem(f"p{i}", "", ""), [
            Trajectory(list(prompt), o.output_token_ids, o.logprobs, o.token_weight_versions,
                       [1] * len(o.output_token_ids), float(s), "length", routed_experts=o.routed_experts)
            for s, o in enumerate(outs)]))
    model = AutoModelForCausalLM.from_pretrained(rollout_dir, dtype=torch.float32)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for router in moe_routers(model):
            router.weight.add_(torch.randn(router.weight.shape, generator=gen) * router.weight.std())
    trainer_dir = root / "trainer"
    model.save_pretrained(trainer_dir)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (trainer_dir / name).write_bytes((rollout_dir / name).read_bytes())
    groups_file = root / "groups.pkl"
    groups_file.write_bytes(pickle.dumps(groups))
    return groups, trainer_dir, groups_file


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_fsdp_ranks_replay_every_micro_batch_as_one_worker_does(setup, tmp_path):
    groups, trainer_dir, groups_file = setup
    ctx = mp.spawn(run_rank, args=(_free_port(), str(trainer_dir), str(groups_file), str(tmp_path)), nprocs=2,
                   join=False)
    deadline = time.monotonic() + SPAWN_TIMEOUT_S
    while not ctx.join(timeout=5):
        if time.monotonic() > deadline:
            for process in ctx.processes:
                process.kill()
            pytest.fail(f"the ranks did not finish within {SPAWN_TIMEOUT_S} s (a hang)")
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    single = LocalPolicyWorker(config(str(trainer_dir)), model_path=str(trainer_dir)).setup()
    checked = watch_experts(single)
    want = TrainingStep(single, single.cfg, pad_id=0)(groups, 0)
    assert want["moe/routing_mismatch"] == 0.0 and want["moe/router_disagreement"] > 0.2 and checked[0] > 0
    for rank in ranks:
        assert rank["checked"] > 0
        got = rank["metrics"]
        assert got["moe/routed_tokens"] == want["moe/routed_tokens"]
        for key in ("moe/routing_mismatch", "moe/router_disagreement", "moe/logprob_gap_replay",
                    "moe/logprob_gap_no_replay"):
            assert got[key] == pytest.approx(want[key], abs=1e-6), key
