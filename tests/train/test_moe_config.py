"""The mixture-of-experts keys: SkyRL's rule between routing replay and the routing record, what a
run refuses (the record on the vLLM backend and from your agent; an MoE model on the dense-only
Megatron worker; replay of a dense model), and where the keys take effect."""

from __future__ import annotations

import pytest

from inflight.config import ConfigError, load_config
from inflight.config.implemented import unimplemented
from inflight.config.job import JobConfig
from inflight.rollout.task_generator import episode_options
from inflight.testing import LOCAL_CPU, make_tiny_model
from inflight.train.moe_support import check_worker_supports
from inflight.train.policy import make_worker

REPLAY = "trainer.policy.megatron_config.moe_enable_routing_replay=true"
RECORD = "generator.inference_engine.enable_return_routed_experts=true"


def _violations(*overrides: str) -> list[str]:
    try:
        load_config(None, [*LOCAL_CPU, *overrides])
    except ConfigError as err:
        return [v.key for v in err.violations]
    return []


def test_replay_needs_the_record_as_in_skyrl():
    assert _violations(REPLAY) == ["trainer.policy.megatron_config.moe_enable_routing_replay"]
    assert _violations(RECORD) == []  # a record without replay: the mismatch metrics of a run without replay
    assert _violations("trainer.ref.megatron_config.moe_enable_routing_replay=true") == [
        "trainer.ref.megatron_config.moe_enable_routing_replay"]
    assert _violations(REPLAY, RECORD) == []
    assert _violations("trainer.moe_logprob_gap_interval=-1") == ["trainer.moe_logprob_gap_interval"]
    cfg = load_config(None, [*LOCAL_CPU, REPLAY, RECORD])
    assert unimplemented(cfg) == [] and episode_options(cfg)["return_routed_experts"] is True
    assert episode_options(load_config(None, list(LOCAL_CPU)))["return_routed_experts"] is False


@pytest.mark.parametrize(
    "where, fix",
    [
        ("generator.inference_engine.backend=vllm", "vLLM 0.32 captures the routing"),
        ("generator.agent.path=pkg.mod:agent", "your agent's episodes"),
    ],
)
def test_a_run_refuses_the_record_where_it_cannot_come(where, fix):
    refused = unimplemented(load_config(None, [*LOCAL_CPU, REPLAY, RECORD, where]))
    assert [v.key for v in refused] == ["generator.inference_engine.enable_return_routed_experts"]
    assert fix in refused[0].rule


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return make_tiny_model(root / "moe", "qwen3_moe"), make_tiny_model(root / "dense", "qwen2")


def test_an_moe_model_on_megatron_is_refused_naming_the_strategy(models):
    moe, dense = models
    cfg = load_config(None, [*LOCAL_CPU, "trainer.strategy=megatron"])
    with pytest.raises(
        ConfigError, match="trainer.strategy='megatron': the Megatron worker takes dense models only"
    ):
        make_worker(cfg, JobConfig(), moe)
    with pytest.raises(ConfigError, match="job.worker='megatron'"):
        check_worker_supports(load_config(None, list(LOCAL_CPU)), moe, "megatron")
    check_worker_supports(cfg, dense, "megatron")
    check_worker_supports(load_config(None, [*LOCAL_CPU, REPLAY, RECORD]), moe, "fsdp")


def test_replay_of_a_dense_model_is_refused_naming_the_key(models):
    _, dense = models
    cfg = load_config(None, [*LOCAL_CPU, REPLAY, RECORD])
    with pytest.raises(
        ConfigError, match="moe_enable_routing_replay=True: .* has no mixture-of-experts layers"
    ):
        make_worker(cfg, JobConfig(), dense)
    from inflight.train.workers.local import LocalPolicyWorker

    worker = LocalPolicyWorker(cfg, model_path=str(dense))  # built directly: the hooks refuse it too
    with pytest.raises(ConfigError, match="Qwen2ForCausalLM has no mixture-of-experts router"):
        worker.build_model()
