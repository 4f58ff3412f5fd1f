"""plan_weight_sync over the whole configuration space: every cell named, the design table as data."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from inflight.config import ConfigError, load_config
from inflight.testing import LOCAL_CPU
from inflight.weight_sync import SyncPlan, plan_weight_sync

BOOL_KEYS = (
    "trainer.placement.colocate_all",
    "trainer.fully_async.enabled",
    "trainer.fully_async.clear_kv_cache_on_weight_sync",
    "generator.inference_engine.offload_kv_for_weight_sync",
    "generator.inference_engine.enable_prefix_caching",
)
SHORT = ("colocate", "async", "clear", "offload", "prefix")

# docs/design.md section 4, transcribed: (colocate, fully_async, clear, offload) ->
# (sleep, offload_kv, kv_fate, reset_running_requests, reset_prefix_cache_if_prefix_caching).
# `None` for clear means "any" (the key is ignored by the synchronous trainer).
TABLE = {
    (False, False, None, False): (False, False, "none", False, True),
    (False, False, None, True): (True, False, "none", False, True),
    (False, True, False, False): (False, False, "keep", False, False),
    (False, True, False, True): (True, True, "offload", False, False),
    (False, True, True, False): (False, False, "recompute", True, True),
    (False, True, True, True): (True, False, "recompute", True, True),
    (True, False, None, False): (True, False, "none", False, True),  # colocated row
}
INVALID = {(True, True), (True, "offload")}  # colocate + fully_async; colocate + offload


def _cells():
    for bools in itertools.product((False, True), repeat=5):
        for strategy in ("fsdp", "megatron"):
            name = "-".join(f"{s}{int(b)}" for s, b in zip(SHORT, bools, strict=True))
            yield pytest.param(bools, strategy, id=f"{name}-{strategy}")


CELLS = list(_cells())


def _cfg(bools, strategy="fsdp"):
    overrides = [f"{k}={str(v).lower()}" for k, v in zip(BOOL_KEYS, bools, strict=True)]
    return load_config(None, [*LOCAL_CPU, *overrides, f"trainer.strategy={strategy}"])


def _valid(bools) -> bool:
    colocate, fully_async, _, offload, _ = bools
    return not (colocate and (fully_async or offload))


def _expected(bools) -> SyncPlan:
    colocate, fully_async, clear, offload, prefix = bools
    row = TABLE.get((colocate, fully_async, clear, offload)) or TABLE[(colocate, fully_async, None, offload)]
    sleep, offload_kv, fate, reset_running, prefix_rule = row
    reset_prefix = prefix_rule and prefix
    return SyncPlan("keep", sleep, offload_kv, fate, reset_prefix, reset_running, colocated=colocate)


@pytest.mark.parametrize(("bools", "strategy"), CELLS)
def test_plan_cell(bools, strategy):
    if not _valid(bools):
        with pytest.raises(ConfigError) as err:
            _cfg(bools, strategy)
        assert "trainer.placement.colocate_all" in str(err.value)
        return
    plan = plan_weight_sync(_cfg(bools, strategy))
    assert plan == _expected(bools)


VALID = [c for c in CELLS if _valid(c.values[0])]


@pytest.mark.parametrize(("bools", "strategy"), VALID)
def test_invariants(bools, strategy):
    colocate, fully_async, clear, offload, prefix = bools
    plan = plan_weight_sync(_cfg(bools, strategy))
    in_flight = plan.kv_fate != "none"
    assert in_flight == (fully_async and not colocate)
    # KV of in-flight requests discarded (recompute, or a sleep without a host copy) => reset them.
    if in_flight and (plan.kv_fate == "recompute" or (plan.sleep and not plan.offload_kv)):
        assert plan.reset_running_requests
    if fully_async and clear:
        assert plan.reset_running_requests and plan.kv_fate == "recompute"
    if not fully_async and not prefix:
        assert not plan.resets
    if fully_async and not clear:
        assert not plan.resets and plan.kv_fate in ("keep", "offload")
    assert plan.offload_kv == (plan.kv_fate == "offload")
    assert not plan.offload_kv or plan.sleep
    assert plan.pause_mode == "keep"
    assert plan.sleeps == (plan.sleep and not plan.colocated) and plan.wakes == (plan.sleep or plan.colocated)


FSDP_CELLS = [c for c in VALID if c.values[1] == "fsdp"]


@pytest.mark.parametrize(("bools", "strategy"), FSDP_CELLS)
def test_same_plan_for_fsdp_and_megatron(bools, strategy):
    fsdp = plan_weight_sync(_cfg(bools, strategy))
    assert plan_weight_sync(_cfg(bools, "megatron")) == fsdp


@pytest.mark.parametrize(("bools", "strategy"), VALID)
def test_steps_follow_the_plan(bools, strategy):
    plan = plan_weight_sync(_cfg(bools, strategy))
    steps = plan.steps()
    assert steps[0] == "pause" and steps[-1] == "resume"
    assert ("sleep" in steps) == (plan.sleep and not plan.colocated)
    asleep = plan.sleep or plan.colocated
    expected_core = ["wake_up_weights", "send_weights", "wake_up_kv_cache"] if asleep else ["send_weights"]
    assert [s for s in steps if s in ("wake_up_weights", "send_weights", "wake_up_kv_cache")] == expected_core
    assert ("reset" in steps) == plan.resets  # the executor alone issues the reset
    if "reset" in steps:
        assert steps.index("reset") > steps.index("send_weights")


def test_issue_4_seed_block_resets_running_requests(tmp_path):
    path = tmp_path / "seed.yaml"
    path.write_text(
        "trainer.placement.colocate_all: false\n"
        "trainer.fully_async.enabled: true\n"
        "trainer.fully_async.clear_kv_cache_on_weight_sync: true\n"
        "generator.inference_engine.offload_kv_for_weight_sync: true\n"
        "generator.inference_engine.enable_prefix_caching: false\n"
        "trainer.train_batch_size: 256\n"  # fully async: one mini-batch (SkyRL's 256) per step
    )
    plan = plan_weight_sync(load_config(path))
    # on vLLM (SkyRL's default)
    assert plan == SyncPlan("keep", True, False, "recompute", False, True, takes_adapters=False)
    assert plan.steps() == (
        "pause", "sleep", "wake_up_weights", "send_weights", "wake_up_kv_cache", "reset", "resume",
    )  # fmt: skip


def test_default_config_is_fully_async_keep_without_resets():
    plan = plan_weight_sync(load_config(None, list(LOCAL_CPU)))
    assert (plan.kv_fate, plan.sleep, plan.resets) == ("keep", False, False)


def test_plan_is_pure():
    cfg = _cfg((False, True, True, True, True))
    before = dataclasses.asdict(cfg)
    assert plan_weight_sync(cfg) == plan_weight_sync(cfg)
    assert dataclasses.asdict(cfg) == before
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan_weight_sync(cfg).sleep = False  # type: ignore[misc]


def test_plan_refuses_contradictory_config_listing_every_violation():
    cfg = load_config(
        None, [*LOCAL_CPU, "trainer.fully_async.enabled=false", "trainer.placement.colocate_all=true"]
    )
    cfg.trainer.fully_async.enabled = True
    cfg.generator.inference_engine.offload_kv_for_weight_sync = True
    with pytest.raises(ConfigError) as err:
        plan_weight_sync(cfg)
    assert err.value.keys == [
        "trainer.placement.colocate_all",
        "generator.inference_engine.offload_kv_for_weight_sync",
    ]


def test_plan_rejects_wrong_types_in_the_keys_it_reads():
    cfg = load_config(None, list(LOCAL_CPU))
    cfg.trainer.fully_async.clear_kv_cache_on_weight_sync = "false"  # truthy string: must not be guessed
    with pytest.raises(ConfigError, match="expected bool"):
        plan_weight_sync(cfg)


def test_a_lora_policy_sends_full_weights_to_vllm_and_its_adapter_to_native_engines():
    lora = ["trainer.policy.model.lora.rank=8"]
    native = plan_weight_sync(load_config(None, [*LOCAL_CPU, *lora]))
    on_vllm = plan_weight_sync(
        load_config(None, [*LOCAL_CPU, *lora, "generator.inference_engine.backend=vllm"])
    )
    assert (native.takes_adapters, native.full_weights) == (True, False)
    assert (on_vllm.takes_adapters, on_vllm.full_weights) == (False, True)
    assert on_vllm.steps() == native.steps()  # the same steps; only what the send carries differs
