"""scripts/gpu_check.sh is prepared for a CUDA machine: its syntax is checked here, and without
CUDA it refuses at once, saying why (nothing is installed or run)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.sh"
BASH = shutil.which("bash")


def _run(path_dir: Path) -> subprocess.CompletedProcess:
    env = {"PATH": str(path_dir), "OUT": str(path_dir / "out")}
    return subprocess.run([BASH, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=30)


def test_the_script_parses():
    assert subprocess.run([BASH, "-n", str(SCRIPT)], capture_output=True, text=True).returncode == 0


def test_without_nvidia_smi_it_refuses_and_says_where_the_cpu_checks_are(tmp_path):
    proc = _run(tmp_path)  # a PATH with nothing on it: no nvidia-smi
    assert proc.returncode == 2 and proc.stdout == ""
    assert (
        "no nvidia-smi on PATH: this is not a CUDA machine" in proc.stderr and "pytest -m vllm" in proc.stderr
    )
    assert not (tmp_path / "out").exists()  # refused before anything is created


def test_with_an_nvidia_smi_that_sees_no_gpu_it_refuses(tmp_path):
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\necho 'NVIDIA-SMI has failed' >&2\nexit 9\n")
    fake.chmod(0o755)
    proc = _run(tmp_path)
    assert proc.returncode == 2 and "nvidia-smi sees no GPU" in proc.stderr
