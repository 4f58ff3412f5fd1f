"""The megatron CPU shim refuses a megatron-core version it was not written for, before patching anything.

(That it makes megatron-core run on CPU is shown by test_megatron_worker.py, whose ranks run behind it.)
"""

from __future__ import annotations

import pytest
import torch

from inflight.megatron import cpu_shim as megatron_cpu_shim


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the shim is never applied")
@pytest.mark.parametrize("found", ["0.15.0", None])
def test_wrong_or_missing_version_is_refused_with_the_fix(monkeypatch, found):
    monkeypatch.setattr(megatron_cpu_shim, "installed_version", lambda: found)
    monkeypatch.setattr(megatron_cpu_shim, "_applied", False)
    current_device = torch.cuda.current_device
    with pytest.raises(megatron_cpu_shim.MegatronCpuShimError) as err:
        megatron_cpu_shim.apply()
    message = str(err.value)
    assert f"megatron-core=={megatron_cpu_shim.PINNED_VERSION}" in message
    assert (f"megatron-core=={found} is installed" if found else "no megatron-core is installed") in message
    assert torch.cuda.current_device is current_device and not megatron_cpu_shim._applied


def test_pinned_version_matches_the_package_extra():
    import tomllib
    from pathlib import Path

    pyproject = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    extra = pyproject["project"]["optional-dependencies"]["megatron"]
    assert extra == [f"megatron-core=={megatron_cpu_shim.PINNED_VERSION}"]
