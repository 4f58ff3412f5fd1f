"""The side venvs' scripts (scripts/{vllm,trl,verifiers}_venv.sh) share scripts/lib: `venv_has.py`
decides from package metadata whether a venv already has what its script installs, so a second run
changes nothing; a missing module or another version means installing."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
TORCH = version("torch").split("+")[0]


def _has(*args: str) -> int:
    return subprocess.run([sys.executable, str(SCRIPTS / "lib" / "venv_has.py"), *args]).returncode


@pytest.mark.parametrize(("args", "code"), [
    ((f"torch=={TORCH}", "--modules", "numpy"), 0),
    ((f"torch=={TORCH} numpy", "--torch-if-any", TORCH), 0),  # a name without == only needs to be there
    (("torch==0.0.1",), 1),
    ((f"torch=={TORCH}", "--modules", "no_such_distribution_here"), 1),
    (("no_such_distribution_here==1.0",), 1),
    (("no_such_distribution_here",), 1),
    (("numpy", "--torch-if-any", "0.0.1"), 1),
])
def test_venv_has_reads_versions_and_modules(args, code):
    assert _has(*args) == code


def test_every_side_venv_script_uses_the_shared_library():
    for name in ("vllm_venv.sh", "trl_venv.sh", "verifiers_venv.sh"):
        text = (SCRIPTS / name).read_text()
        assert "source scripts/lib/side_venv.sh" in text and "side_venv_check" in text, name
