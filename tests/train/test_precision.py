"""`trainer.bf16`: null chooses bfloat16 where the device computes it natively, and a run says which."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from inflight.config import Config, load_config
from inflight.testing.configs import LOCAL_CPU
from inflight.train.workers import local
from inflight.train.workers.local import describe_precision, native_bf16, use_bf16


def make_config(*overrides: str) -> Config:
    return load_config(None, [*LOCAL_CPU, *overrides])


def _proc_flags() -> set[str]:
    """The CPU's flags read straight from /proc/cpuinfo (not through inflight.engine.cpu)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        pytest.skip("no /proc/cpuinfo")
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return set(line.split(":", 1)[-1].split())


def test_null_picks_bfloat16_exactly_where_the_cpu_multiplies_it_natively() -> None:
    cfg = make_config("trainer.bf16=null")
    flags = _proc_flags()
    assert use_bf16(cfg, torch.device("cpu")) == bool(flags & {"amx_bf16", "avx512_bf16"})


@pytest.mark.parametrize(
    "flags, want",
    [
        ({"avx2", "fma"}, False), ({"avx512f", "avx512bw"}, False), ({"avx512f", "avx512_bf16"}, True),
        ({"amx_tile", "amx_bf16"}, True),
    ],
)
def test_null_follows_the_cpu_flags(monkeypatch: pytest.MonkeyPatch, flags: set[str], want: bool) -> None:
    monkeypatch.setattr(local, "cpu_flags", lambda: frozenset(flags))
    cfg = make_config("trainer.bf16=null")
    assert use_bf16(cfg, torch.device("cpu")) is want
    line = describe_precision(cfg, torch.device("cpu"))
    assert line.startswith("training precision: " + ("bfloat16" if want else "float32"))
    assert "trainer.bf16=null" in line


def test_explicit_values_are_kept_and_a_slow_bfloat16_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(local, "cpu_flags", lambda: frozenset({"avx2"}))
    assert use_bf16(make_config("trainer.bf16=true"), torch.device("cpu")) is True
    assert use_bf16(make_config("trainer.bf16=false"), torch.device("cpu")) is False
    warning = describe_precision(make_config("trainer.bf16=true"), torch.device("cpu"))
    assert "slower than float32" in warning and "trainer.bf16=false or null" in warning
    assert native_bf16(torch.device("cuda"))[0]


def test_the_worker_autocasts_to_what_null_chose(monkeypatch: pytest.MonkeyPatch) -> None:
    for flags, dtype in (({"avx2"}, None), ({"amx_bf16"}, torch.bfloat16)):
        monkeypatch.setattr(local, "cpu_flags", lambda f=flags: frozenset(f))
        worker = local.LocalPolicyWorker(make_config("trainer.bf16=null"), model_path="unused")
        context = worker.autocast()
        assert (getattr(context, "fast_dtype", None)) == dtype
