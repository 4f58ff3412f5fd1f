"""A spawned FSDP rank (gloo, 2 ranks) running one training step of a mixture of experts with routing
replay (see test_moe_data_parallel.py): every forward's experts, at every MoE block, checked against
the record its micro-batch carries."""

from __future__ import annotations

import datetime
import os
import pickle
from pathlib import Path

import torch
import torch.distributed as dist

from inflight.config import load_config
from inflight.testing import LOCAL_CPU
from inflight.train.step import TrainingStep

REPLAY = ("trainer.policy.megatron_config.moe_enable_routing_replay=true",
          "generator.inference_engine.enable_return_routed_experts=true")
STEP = (
    "trainer.train_batch_size=4", "trainer.policy_mini_batch_size=2",
    "trainer.micro_train_batch_size_per_gpu=1", "trainer.fully_async.enabled=false",
    "trainer.moe_logprob_gap_interval=1", "trainer.algorithm.off_policy_correction.tis_ratio_type=null",
)


def config(model_dir: str):
    return load_config(None, [*LOCAL_CPU, f"trainer.policy.model.path={model_dir}", *STEP, *REPLAY])


def watch_experts(worker) -> list[int]:
    """Pre-hooks on every sparse block's experts: the indices they run must be the record where the
    replayed batch has one; returns a one-item list counting the checked (forward, layer) pairs."""
    checked = [0]
    blocks = [m for n, m in worker.model.named_modules() if n.endswith("mlp") and hasattr(m, "experts")]

    def hook(layer: int):
        def check(module, args):
            rows = worker.routing._rows
            if rows is None or not worker.routing.replay:  # the gap metric's forward without replay
                return
            recorded = rows[:, layer].long()
            has = recorded[:, 0] >= 0
            assert torch.equal(args[1][has], recorded[has]), (
                f"MoE layer {layer} ran other experts than recorded"
            )
            checked[0] += 1
        return check

    for j, block in enumerate(blocks):
        block.experts.register_forward_pre_hook(hook(j))
    return checked


def run_rank(rank: int, port: int, model_dir: str, groups_file: str, out_dir: str) -> None:
    from inflight.train.workers.fsdp import FSDPPolicyWorker

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=90))
    try:
        worker = FSDPPolicyWorker(config(model_dir), model_path=model_dir).setup()
        checked = watch_experts(worker)
        groups = pickle.loads(Path(groups_file).read_bytes())
        metrics = TrainingStep(worker, worker.cfg, pad_id=0)(groups, 0)
        torch.save({"metrics": metrics, "checked": checked[0]}, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()
