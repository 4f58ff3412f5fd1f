"""The policy-worker strategies' registry (`inflight.train.strategies`): the kinds agree with what
the config accepts, each names a real worker class, and `job.worker=auto` picks as before."""

from __future__ import annotations

import dataclasses

import pytest

from inflight.config.job import JobConfig
from inflight.config.schema.trainer import STRATEGY_ALIASES, TrainerConfig
from inflight.train.strategies import (
    Strategy,
    pick_strategy,
    register_strategy,
    strategy_aliases,
    strategy_entry,
    strategy_names,
    worker_names,
)
from inflight.train.workers.base import PolicyWorker


def test_the_entries_are_the_configs_choices_and_aliases():
    field = {f.name: f for f in dataclasses.fields(TrainerConfig)}["strategy"]
    assert strategy_names() == tuple(field.metadata["choices"])
    assert strategy_aliases() == STRATEGY_ALIASES
    assert JobConfig(worker="nope").validate()[0].fix == f"use one of {', '.join(('auto', *worker_names()))}"
    for name in worker_names():
        assert not JobConfig(worker=name).validate()


@pytest.mark.parametrize("name", ["local", "fsdp", "megatron"])
def test_each_entry_names_its_policy_worker_class(name):
    if name == "megatron":
        pytest.importorskip(
            "megatron.core", reason="megatron-core is not installed; pip install -e '.[megatron]'"
        )
    entry = strategy_entry(name)
    assert issubclass(entry.worker_class(), PolicyWorker)
    assert entry.worker_class().__module__ == entry.worker.partition(":")[0]
    if entry.critic is None:
        with pytest.raises(ValueError, match=f"a critic on the {name} worker is not implemented"):
            entry.worker_class("critic")
    else:
        assert issubclass(entry.worker_class("critic"), entry.worker_class())


def test_auto_picks_the_strategys_worker_and_local_without_a_process_group():
    assert pick_strategy("fsdp", "auto", distributed=False).name == "local"
    assert pick_strategy("fsdp", "auto", distributed=True).name == "fsdp"
    assert pick_strategy("fsdp2", "auto", distributed=True).name == "fsdp"  # SkyRL's spelling
    assert pick_strategy("megatron", "auto", distributed=False).name == "megatron"
    assert pick_strategy("megatron", "local", distributed=True).name == "local"  # job.worker wins
    assert not strategy_entry("local").distributed and strategy_entry("megatron").distributed


def test_what_each_worker_refuses_is_on_its_entry():
    assert strategy_entry("megatron").critic is None
    assert strategy_entry("megatron").moe_refusal and strategy_entry("megatron").vision_refusal
    assert all(strategy_entry(n).moe_refusal is None for n in ("local", "fsdp"))


def test_unknown_and_taken_names_are_clear_errors():
    with pytest.raises(ValueError, match="'deepspeed' is not registered; known: local, fsdp, megatron"):
        strategy_entry("deepspeed")
    with pytest.raises(ValueError, match=r"\['fsdp2'\] already name a registered strategy"):
        register_strategy(Strategy("other", worker="x:y", aliases=("fsdp2",)))
