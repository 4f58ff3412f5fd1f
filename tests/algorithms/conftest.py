"""The oracles of tests/algorithms: SkyRL 0.3.0's and verl 0.9.1's own algorithm modules.

scripts/bootstrap.sh installs them (without their dependencies, plus the few modules their algorithm
files import) into .venv/oracles, a folder only these tests put on sys.path. When they cannot be
imported the tests fail, naming the fix; nothing is skipped.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from oracle_import import import_oracle


@pytest.fixture(scope="session")
def skyrl() -> SimpleNamespace:
    """SkyRL 0.3.0: `ppo` (ppo_utils), `opc` (off_policy_correction_utils), `torch_utils`, `config`
    (skyrl.train.config: AlgorithmConfig and its sections)."""
    return SimpleNamespace(
        ppo=import_oracle("skyrl.backends.skyrl_train.utils.ppo_utils"),
        opc=import_oracle("skyrl.backends.skyrl_train.utils.off_policy_correction_utils"),
        torch_utils=import_oracle("skyrl.backends.skyrl_train.utils.torch_utils"),
        config=import_oracle("skyrl.train.config"),
    )


@pytest.fixture(scope="session")
def skyrl_trainer() -> SimpleNamespace:
    """SkyRL 0.3.0's trainer side (slower to import): `trainer` (RayPPOTrainer), `trainer_utils`,
    `preprocess` (prompt boundaries), `batch` (TrainingInputBatch)."""
    return SimpleNamespace(
        trainer=import_oracle("skyrl.train.trainer"),
        trainer_utils=import_oracle("skyrl.train.utils.trainer_utils"),
        preprocess=import_oracle("skyrl.train.dataset.preprocess"),
        batch=import_oracle("skyrl.backends.skyrl_train.training_batch"),
    )


@pytest.fixture(scope="session")
def verl() -> SimpleNamespace:
    """verl 0.9.1: `algos` (trainer.ppo.core_algos), `F` (utils.torch_functional), `config`
    (workers.config: FSDPActorConfig, PolicyLossConfig)."""
    return SimpleNamespace(
        algos=import_oracle("verl.trainer.ppo.core_algos"),
        F=import_oracle("verl.utils.torch_functional"),
        config=import_oracle("verl.workers.config"),
    )
