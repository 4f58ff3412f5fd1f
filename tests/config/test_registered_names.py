"""The advantage estimators and policy losses a run takes are checked without importing torch
(`inflight.config.implemented.BUILT_IN_NAMES`), and those names are the ones the registries hold."""

from __future__ import annotations

import pytest

from inflight.config import load_config
from inflight.config.implemented import BUILT_IN_NAMES, registered_names, unimplemented


def _built_in(registry) -> list[str]:
    """The names `inflight.algorithms.adapters` registered (not those other tests add)."""
    return [n for n in registry.names() if registry.get(n).__module__.startswith("inflight.algorithms")]


def test_the_built_in_names_are_what_inflight_algorithms_registers():
    from inflight.algorithms import ADVANTAGE_ESTIMATORS, POLICY_LOSSES

    assert list(BUILT_IN_NAMES["trainer.algorithm.advantage_estimator"][1]) == _built_in(ADVANTAGE_ESTIMATORS)
    assert list(BUILT_IN_NAMES["trainer.algorithm.policy_loss_type"][1]) == _built_in(POLICY_LOSSES)


@pytest.mark.parametrize("key", sorted(BUILT_IN_NAMES))
def test_a_name_a_user_registers_before_the_run_is_taken(key):
    from inflight.algorithms import ADVANTAGE_ESTIMATORS, POLICY_LOSSES

    registry = ADVANTAGE_ESTIMATORS if key.endswith("advantage_estimator") else POLICY_LOSSES
    cfg = load_config(None, [f"{key}=my_own"])
    assert [v.key for v in unimplemented(cfg)] == [key]
    registry.register("my_own", lambda *a, **k: None)
    try:
        assert "my_own" in registered_names(key)
        assert key not in [v.key for v in unimplemented(cfg)]
    finally:
        registry.unregister("my_own")
