"""The GPU-count keys against the CUDA devices of the node (`inflight.orchestration.device_counts`), with the
device count monkeypatched: `inflight train` refuses a run that asks for more GPUs than there are,
naming the key and both numbers, before anything starts; nothing is counted on CPU."""

from __future__ import annotations

import pytest
import torch

from inflight.config import load_config
from inflight.config.job import JobConfig
from inflight.orchestration.device_counts import too_many_gpus
from inflight.testing import LOCAL_CPU
from inflight.train.main import missing_devices

IE = "generator.inference_engine."
CUDA = JobConfig(trainer_device="cuda")


def _cfg(*overrides: str):
    return load_config(None, [*LOCAL_CPU, *overrides])


@pytest.fixture
def two_gpus(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)


def test_counts_beyond_the_nodes_gpus_are_refused_naming_key_and_numbers(two_gpus):
    cfg = _cfg("trainer.placement.policy_num_gpus_per_node=4", f"{IE}device=cuda", f"{IE}num_engines=3")
    message = missing_devices(cfg, CUDA)
    assert "trainer.placement.policy_num_gpus_per_node=4 asks for 4 GPUs, but this node has 2" in message
    assert f"{IE}num_engines * {IE}tensor_parallel_size=3 asks for 3 GPUs, but this node has 2" in message
    assert message.endswith("; fit the keys to this node's GPUs, or run on a node with more")
    assert missing_devices(_cfg("trainer.placement.policy_num_gpus_per_node=2", f"{IE}device=cuda",
                                f"{IE}num_engines=2"), CUDA) is None  # exactly what the node has


def test_each_placement_key_is_checked(two_gpus):
    for key in ("policy_num_gpus_per_node", "critic_num_gpus_per_node", "ref_num_gpus_per_node"):
        cfg = _cfg()
        setattr(cfg.trainer.placement, key, 3)  # the critic's and reference's are refused above 1 anyway
        assert too_many_gpus(cfg, CUDA) == (
            f"trainer.placement.{key}=3 asks for 3 GPUs, but this node has 2 "
            "(torch.cuda.device_count()); fit the keys to this node's GPUs, or run "
            "on a node with more"
        )


def test_only_what_runs_on_cuda_here_is_counted(two_gpus):
    many = ("trainer.placement.policy_num_gpus_per_node=8", f"{IE}num_engines=8")
    assert too_many_gpus(_cfg(*many), JobConfig()) is None  # CPU: a policy rank is a process
    engines_only = too_many_gpus(_cfg(*many, f"{IE}device=cuda"), JobConfig())
    assert engines_only.startswith(f"{IE}num_engines * {IE}tensor_parallel_size=8")
    assert too_many_gpus(_cfg(*many, f"{IE}device=cuda"), JobConfig(ray=True)) is None  # Ray places engines
    urls = ",".join(f"http://h:{port}" for port in range(1, 9))
    external = (f"{IE}run_engines_locally=false", f"{IE}external_server_urls=[{urls}]",
                f"{IE}weight_sync_backend=inprocess")
    assert too_many_gpus(load_config(None, ["trainer.placement.colocate_all=false", f"{IE}num_engines=8",
                                            f"{IE}device=cuda", *external]), JobConfig()) is None
    assert too_many_gpus(_cfg(f"{IE}device=cuda", f"{IE}num_engines=3"), JobConfig(), device_count=4) is None


def test_a_device_key_naming_a_gpu_the_node_lacks_is_refused(two_gpus):
    message = missing_devices(_cfg(f"{IE}device=cuda:1"), JobConfig(trainer_device="cuda:2"))
    assert message.startswith("job.trainer_device=cuda:2 names GPU 2, but this node has 2 (cuda:0 to cuda:1)")
    assert missing_devices(_cfg(f"{IE}device=cuda:1"), JobConfig(trainer_device="cuda:0")) is None
