"""Rules this project shares with SkyRL 0.3.0, held to SkyRL's own code (tests/oracle_import.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from oracle_import import import_oracle

from inflight.config import ConfigError, load_config
from inflight.testing import LOCAL_CPU

FA = "trainer.fully_async."


def _skyrl_accepts(mini: int, staleness: int, workers: int) -> bool:
    """Whether SkyRL's FullyAsyncRayPPOTrainer takes these settings: its constructor asserts the
    bound before anything else (what follows fails on the bare config, which counts as taken)."""
    trainer = import_oracle("skyrl.train.fully_async_trainer").FullyAsyncRayPPOTrainer
    fully_async = SimpleNamespace(num_parallel_generation_workers=workers, max_staleness_steps=staleness,
                                  sample_full_batch=False)
    cfg = SimpleNamespace(trainer=SimpleNamespace(fully_async=fully_async, policy_mini_batch_size=mini))
    try:
        trainer.__init__(trainer.__new__(trainer), cfg=cfg)
    except AssertionError as err:
        assert "num_parallel_generation_workers" in str(err)
        return False
    except Exception:  # noqa: BLE001 - past the assertion: the rest needs a real run
        return True
    return True


@pytest.mark.parametrize(("mini", "staleness"), [(8, 0), (8, 4), (32, 1), (4, 8)])
def test_generation_workers_bound_is_skyrls(mini, staleness):
    for workers in (mini - 1, mini, mini * (staleness + 1), mini * (staleness + 1) + 1):
        overrides = [*LOCAL_CPU, f"trainer.train_batch_size={mini}", f"trainer.policy_mini_batch_size={mini}",
                     f"{FA}max_staleness_steps={staleness}", f"{FA}num_parallel_generation_workers={workers}"]
        try:
            load_config(None, overrides)
            ours = True
        except ConfigError as err:
            assert f"{FA}num_parallel_generation_workers" in err.keys
            assert "SkyRL's fully-async trainer asserts the same" in str(err)
            ours = False
        assert ours == _skyrl_accepts(mini, staleness, workers), (mini, staleness, workers)
