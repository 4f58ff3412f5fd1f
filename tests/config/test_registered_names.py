"""The advantage estimators and policy losses a run takes are the registries' own names
(`inflight.algorithms.registry`, read without torch), and what a loss registered about itself is what
validation checks: a loss registered in a test is taken with no other file changed."""

from __future__ import annotations

import subprocess
import sys

import pytest

from inflight.algorithms import POLICY_LOSSES, register_policy_loss
from inflight.config import ConfigError, load_config
from inflight.config.implemented import REGISTRY_KEYS, registered_names, unimplemented

TIS = "trainer.algorithm.off_policy_correction.tis_ratio_type=token"


def test_validation_reads_the_registry_without_torch():
    code = ("import sys\nfrom inflight.config import load_config\n"
            "from inflight.config.implemented import registered_names, unimplemented\n"
            "cfg = load_config(None, ['trainer.algorithm.policy_loss_type=gspo'])\n"
            "assert unimplemented(cfg) == [], unimplemented(cfg)\n"
            "assert 'cross_entropy' in registered_names('trainer.algorithm.policy_loss_type')\n"
            "assert 'torch' not in sys.modules\n")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("key", sorted(REGISTRY_KEYS))
def test_a_name_a_user_registers_before_the_run_is_taken(key):
    from inflight.algorithms import ADVANTAGE_ESTIMATORS

    registry = ADVANTAGE_ESTIMATORS if key.endswith("advantage_estimator") else POLICY_LOSSES
    cfg = load_config(None, [f"{key}=my_own"])
    assert [v.key for v in unimplemented(cfg)] == [key]
    registry.register("my_own", lambda *a, **k: None)
    try:
        assert "my_own" in registered_names(key)
        assert key not in [v.key for v in unimplemented(cfg)]
    finally:
        registry.unregister("my_own")


@pytest.mark.parametrize("corrects", [True, False])
def test_a_newly_registered_loss_is_validated_by_what_it_registered(corrects):
    """Registering is all it takes: the name is accepted, and the off-policy correction is refused
    with it exactly when it registered that it does not apply one."""
    key = "trainer.algorithm.policy_loss_type"
    register_policy_loss("fresh_loss", lambda *a, **k: None, applies_off_policy_correction=corrects)
    try:
        assert unimplemented(load_config(None, [f"{key}=fresh_loss"])) == []
        if corrects:
            cfg = load_config(None, [f"{key}=fresh_loss", TIS])
            assert cfg.trainer.algorithm.policy_loss_type == "fresh_loss"
        else:
            with pytest.raises(ConfigError, match="does not apply the off-policy correction") as err:
                load_config(None, [f"{key}=fresh_loss", TIS])
            assert [v.key for v in err.value.violations] == [key]
    finally:
        POLICY_LOSSES.unregister("fresh_loss")
