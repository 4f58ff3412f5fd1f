"""The oracles of tests/algorithms: SkyRL 0.3.0's and verl 0.9.1's own algorithm modules.

scripts/bootstrap.sh installs them (without their dependencies, plus the few modules their algorithm
files import) into .venv/oracles, a folder only these tests put on sys.path. When they cannot be
imported the tests fail, naming the fix; nothing is skipped.
"""

from __future__ import annotations

import importlib
import logging
import sys
import typing
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest

ORACLE_DIR = Path(sys.prefix) / "oracles"


def _import_oracle(name: str) -> ModuleType:
    if str(ORACLE_DIR) not in sys.path:
        sys.path.append(str(ORACLE_DIR))
    import typing_extensions

    # SkyRL 0.3.0 declares Python >= 3.11 but its Tinker types put a `typing.TypedDict` in a pydantic
    # model, which pydantic refuses before Python 3.12; its typing_extensions twin is accepted. Only
    # while SkyRL's modules import. verl's import calls logging.basicConfig: the root logger is restored.
    root = logging.getLogger()
    handlers, level, typed_dict = list(root.handlers), root.level, typing.TypedDict
    typing.TypedDict = typing_extensions.TypedDict
    try:
        return importlib.import_module(name)
    except Exception as err:  # ImportError, or the oracle's own error while importing
        pytest.fail(
            f"cannot import the test oracle {name} from {ORACLE_DIR} ({type(err).__name__}: {err}): "
            "run scripts/bootstrap.sh, which installs SkyRL and verl there",
            pytrace=False,
        )
    finally:
        typing.TypedDict = typed_dict
        root.handlers[:] = handlers
        root.setLevel(level)


@pytest.fixture(scope="session")
def skyrl() -> SimpleNamespace:
    """SkyRL 0.3.0: `ppo` (ppo_utils), `opc` (off_policy_correction_utils), `torch_utils`, `config`
    (skyrl.train.config: AlgorithmConfig and its sections)."""
    return SimpleNamespace(
        ppo=_import_oracle("skyrl.backends.skyrl_train.utils.ppo_utils"),
        opc=_import_oracle("skyrl.backends.skyrl_train.utils.off_policy_correction_utils"),
        torch_utils=_import_oracle("skyrl.backends.skyrl_train.utils.torch_utils"),
        config=_import_oracle("skyrl.train.config"),
    )


@pytest.fixture(scope="session")
def skyrl_trainer() -> SimpleNamespace:
    """SkyRL 0.3.0's trainer side (slower to import): `trainer` (RayPPOTrainer), `trainer_utils`,
    `preprocess` (prompt boundaries), `batch` (TrainingInputBatch)."""
    return SimpleNamespace(
        trainer=_import_oracle("skyrl.train.trainer"),
        trainer_utils=_import_oracle("skyrl.train.utils.trainer_utils"),
        preprocess=_import_oracle("skyrl.train.dataset.preprocess"),
        batch=_import_oracle("skyrl.backends.skyrl_train.training_batch"),
    )


@pytest.fixture(scope="session")
def verl() -> SimpleNamespace:
    """verl 0.9.1: `algos` (trainer.ppo.core_algos), `F` (utils.torch_functional), `config`
    (workers.config: FSDPActorConfig, PolicyLossConfig)."""
    return SimpleNamespace(
        algos=_import_oracle("verl.trainer.ppo.core_algos"),
        F=_import_oracle("verl.utils.torch_functional"),
        config=_import_oracle("verl.workers.config"),
    )
