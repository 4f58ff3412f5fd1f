"""Hybrid sharding (`fsdp_config.fsdp_size`, SkyRL's HSDP): 4 gloo ranks as 2 replicas each sharded
over 2 ranks. One training step, every rank on its own row, lands on the weights one unsharded
transformers model gets from the 4 rows as 4 micro-batches (plain SGD, so the update is the averaged
gradient itself); the parameters live on a (2, 2) mesh, replicated on one dimension and sharded on
the other; a size that does not divide the ranks is refused when the config is validated."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from inflight.config import ConfigError, load_config
from inflight.testing import LOCAL_CPU, make_tiny_model
from inflight.train import TrainBatch
from inflight.train.workers import LocalPolicyWorker

WORLD, FSDP_SIZE, LR = 4, 2, 0.5


def _cfg(model_dir: Path, *extra: str):
    return load_config(None, [
        *LOCAL_CPU, f"trainer.policy.model.path={model_dir}", "trainer.strategy=fsdp",
        f"trainer.placement.policy_num_gpus_per_node={WORLD}",
        f"generator.inference_engine.num_engines={WORLD}", "trainer.micro_train_batch_size_per_gpu=1",
        "trainer.policy.optimizer_config.max_grad_norm=1e9", *extra,
    ])  # fmt: skip


def _batch(vocab: int) -> TrainBatch:
    gen = torch.Generator().manual_seed(3)
    input_ids = torch.randint(3, vocab, (WORLD, 9), generator=gen)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, 6:] = 0
    loss_mask = attention_mask.clone()
    loss_mask[:, :3] = 0
    return TrainBatch(input_ids=input_ids, loss_mask=loss_mask, attention_mask=attention_mask)


def _sgd(worker) -> None:
    worker.optimizer = torch.optim.SGD(worker.optimizer_parameters(), lr=LR)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank(rank: int, port: int, model_dir: Path, out: Path) -> None:
    from torch.distributed.tensor import Replicate, Shard

    from inflight.train.workers.fsdp import FSDPPolicyWorker

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        worker = FSDPPolicyWorker(
            _cfg(model_dir, f"trainer.policy.fsdp_config.fsdp_size={FSDP_SIZE}")
        ).setup()
        _sgd(worker)
        weight = worker.model.model.layers[0].mlp.up_proj.weight
        layout = (tuple(weight.device_mesh.shape), tuple(weight.placements))
        batch = _batch(worker.model.config.vocab_size)
        metrics = worker.train_step(batch.split(1)[rank])
        trained = worker.full_hf_state_dict()
        if rank == 0:
            torch.save({"layout": layout, "expected_layout": ((2, 2), (Replicate(), Shard(0))),
                        "metrics": metrics, "trained": trained}, out)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("hsdp") / "m", arch="qwen2", seed=6)


@pytest.fixture(scope="module")
def ranks(model_dir, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("hsdp_ranks") / "rank0.pt"
    mp.spawn(_rank, args=(_free_port(), model_dir, out), nprocs=WORLD, join=True)
    return torch.load(out, weights_only=False)


def test_parameters_are_replicated_across_replicas_and_sharded_within_one(ranks):
    assert ranks["layout"] == ranks["expected_layout"]


def test_a_hybrid_step_equals_one_unsharded_worker_on_the_whole_batch(model_dir, ranks):
    reference = LocalPolicyWorker(_cfg(model_dir), model_path=str(model_dir)).setup()
    _sgd(reference)
    before = {n: p.detach().clone() for n, p in reference.model.named_parameters()}
    metrics = reference.train_step(_batch(reference.model.config.vocab_size))
    assert ranks["metrics"]["grad_norm"] == pytest.approx(metrics["grad_norm"], rel=1e-5)
    for name, param in reference.model.named_parameters():
        update = param.detach() - before[name]
        # the update is the gradient (times lr): compared relative to its own size
        torch.testing.assert_close(ranks["trained"][name] - before[name], update,
                                   atol=1e-5 * float(update.abs().max()), rtol=0, msg=name)


@pytest.mark.parametrize("size", [0, 3])
def test_a_size_that_does_not_divide_the_ranks_is_refused_at_validation(tmp_path, size):
    with pytest.raises(ConfigError) as err:
        _cfg(tmp_path, f"trainer.policy.fsdp_config.fsdp_size={size}")
    assert err.value.keys == ["trainer.policy.fsdp_config.fsdp_size"] and "[1, 2]" in str(err.value)
