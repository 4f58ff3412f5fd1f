"""`inflight env`: the CPU, the kernel ISA and why, what each auto backend resolves to, the versions."""

from __future__ import annotations

import json

import pytest
import torch

from inflight import cli
from inflight.engine import cpu, kernels
from inflight.engine.models.linear import resolve_linear_backend


@pytest.fixture(autouse=True)
def native_kernels_on(monkeypatch):
    """The report is checked with the kernels on, whatever INFLIGHT_NATIVE_KERNELS the suite runs with."""
    monkeypatch.delenv("INFLIGHT_NATIVE_KERNELS", raising=False)


def _env(capsys, *args: str) -> str:
    assert cli.main(["env", *args]) == 0
    return capsys.readouterr().out


def test_json_report_says_what_runs_here(capsys):
    info = json.loads(_env(capsys, "--json"))
    assert (
        info["cpu"]["model"] == cpu.cpu_model()
        and info["cpu"]["torch_capability"] == cpu.torch_cpu_capability()
    )
    assert info["cpu"]["flags"]["avx2"] == ("avx2" in cpu.cpu_flags())
    isa = info["kernel_isa"]
    assert isa["chosen"] == kernels.resolve_isa() and isa["build"] == "ok"
    assert ("best level" in isa["why"]) == (kernels.requested_isa() == "native")
    assert set(isa["levels"]) == set(cpu.ISA_LEVELS) and isa["levels"]["portable"] == "runs"
    bf16 = info["auto_backends_cpu"]["bfloat16"]
    assert bf16["linear"].split()[0] == resolve_linear_backend("auto", torch.bfloat16, torch.device("cpu"))
    assert bf16["attention"] == f"native ({kernels.resolve_isa()})"
    assert info["auto_backends_cpu"]["float16"]["attention"] == "torch"
    assert info["versions"]["torch"] == torch.__version__
    assert info["cuda"]["available"] == torch.cuda.is_available()


def test_forced_level_and_its_reason_in_the_text_report(capsys, monkeypatch):
    monkeypatch.setenv("INFLIGHT_KERNEL_ISA", "portable")
    text = _env(capsys)
    assert "chosen: portable" in text and "forced by INFLIGHT_KERNEL_ISA=portable" in text
    assert "elementwise: native (portable)" in text and "INFLIGHT_KERNEL_ISA: portable" in text


def test_a_level_the_cpu_lacks_is_reported_not_raised(capsys, monkeypatch):
    monkeypatch.setattr(cpu, "cpu_flags", lambda: frozenset({"avx2", "fma", "f16c", "bmi2"}))
    monkeypatch.setattr(cpu, "machine", lambda: "x86_64")
    monkeypatch.setenv("INFLIGHT_KERNEL_ISA", "avx512")
    info = json.loads(_env(capsys, "--json"))
    assert info["kernel_isa"]["chosen"] is None and "lacks: avx512f" in info["kernel_isa"]["why"]
    assert info["kernel_isa"]["levels"]["avx512"].startswith("lacks avx512f")
    assert info["auto_backends_cpu"]["float32"]["attention"].startswith("error: INFLIGHT_KERNEL_ISA=avx512")
