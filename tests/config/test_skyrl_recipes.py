"""SkyRL's own launch scripts validate here unchanged, after substitutions that touch only devices
(GPU and node counts, parallel sizes and engine counts to 1, nccl to gloo) and paths (model, data,
outputs): what `inflight train --print-config` checks. What a run would refuse of them is reported,
never a reason for the config not to load."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from inflight.config import ConfigError
from inflight.config.implemented import unimplemented
from inflight.train.main import main, resolve_config

RECIPES = json.loads((Path(__file__).with_name("data") / "skyrl_recipes.json").read_text())["recipes"]

DEVICE_KEYS = re.compile(
    r"(num_gpus_per_node|num_nodes|tensor_parallel_size|pipeline_parallel_size|expert_parallel_size|"
    r"data_parallel_size|tensor_model_parallel_size|pipeline_model_parallel_size|context_parallel_size|"
    r"expert_model_parallel_size|expert_tensor_parallel_size|sequence_parallel_size|num_engines)$")
PATH_KEYS = re.compile(
    r"(model\.path|bf16_base_path|train_data|val_data|ckpt_path|export_path|log_path|resume_path|db_path|"
    r"chat_template|sync_dir|_dir|miniswe_config_path|name_or_path)$")
URL_KEYS = re.compile(r"(external_server_urls|external_proxy_url|search_url|base_url)$")


def localize(overrides: list[str], root: Path) -> list[str]:
    """`overrides` with devices set to one and paths to local ones under `root`; an override whose
    value the script left to its caller (an unset `$VAR` on a key that is neither) is dropped."""
    out = []
    for text in overrides:
        key, _, value = text.lstrip("+").partition("=")
        leaf = key.rsplit(".", 1)[-1]
        if DEVICE_KEYS.search(leaf):
            value = "1" if value not in ("null", "None") else value
        elif key.endswith("num_prefill"):
            value = "0"
        elif key.endswith("weight_sync_backend") and value == "nccl":
            value = "gloo"
        elif URL_KEYS.search(leaf):
            value = "[http://127.0.0.1:8000]" if leaf.endswith("urls") else "http://127.0.0.1:8000"
        elif PATH_KEYS.search(key) and value not in ("null", "None"):
            value = _local_path(key, value, root)
        elif "$" in value:
            continue
        out.append(f"{key}={value}")
    return out


def _local_path(key: str, value: str, root: Path) -> str:
    if key.endswith(("train_data", "val_data")):
        return f"[{root / 'data' / Path(key).suffix.lstrip('.')}.parquet]"
    if key.endswith("model.path") or key.endswith("bf16_base_path"):
        return str(root / "model")
    return str(root / key.replace(".", "_"))


@pytest.mark.parametrize("script", sorted(RECIPES))
def test_a_skyrl_script_validates_after_device_and_path_substitutions(script, tmp_path):
    overrides = localize(RECIPES[script], tmp_path)
    try:
        cfg, _ = resolve_config(None, overrides)
    except ConfigError as err:
        raise AssertionError(f"{script} does not validate:\n{err}") from None
    for violation in unimplemented(cfg):  # refused by a run, with the reason and a fix: never silent
        assert violation.rule and violation.fix


def test_the_recipes_are_skyrls_examples_and_use_most_of_its_keys():
    assert len(RECIPES) >= 100
    keys = {o.split("=", 1)[0].lstrip("+") for overrides in RECIPES.values() for o in overrides}
    assert {"trainer.algorithm.policy_loss_type", "generator.inference_engine.gpu_memory_utilization",
            "trainer.resume_mode", "trainer.placement.colocate_all", "generator.batched"} <= keys


def test_print_config_prints_and_names_what_a_run_would_refuse(tmp_path, capsys):
    script = "examples/train/megatron/run_megatron_dapo_qwen3.6_35b_a3b_lora_int4_qat.sh"
    assert main(["--print-config", *localize(RECIPES[script], tmp_path)]) == 2  # as a run would
    out, err = capsys.readouterr()
    assert "trainer:" in out and "strategy: megatron" in out
    assert "a run would refuse this config" in err and "data.train_data=" in err  # the files are not there


def test_localize_touches_only_devices_and_paths(tmp_path):
    got = localize(
        [
            "trainer.placement.policy_num_gpus_per_node=8",
            "generator.inference_engine.num_engines=4",
            "generator.inference_engine.weight_sync_backend=nccl",
            "trainer.algorithm.eps_clip_high=0.28",
            "trainer.policy.model.path=Qwen/Qwen3-4B",
            "trainer.ckpt_path=/root/ckpts/x",
            "trainer.epochs=20",
            "trainer.remove_microbatch_padding=$UNSET",
        ],
        tmp_path,
    )
    assert got == [
        "trainer.placement.policy_num_gpus_per_node=1",
        "generator.inference_engine.num_engines=1",
        "generator.inference_engine.weight_sync_backend=gloo",
        "trainer.algorithm.eps_clip_high=0.28",
        f"trainer.policy.model.path={tmp_path / 'model'}",
        f"trainer.ckpt_path={tmp_path / 'trainer_ckpt_path'}",
        "trainer.epochs=20",
    ]


NOTHING_REFUSED = 81
"""SkyRL's scripts (of `RECIPES`) a run refuses nothing of, after the device and path substitutions:
a floor that only rises as more of SkyRL is implemented."""


def test_the_scripts_a_run_refuses_nothing_of(tmp_path):
    clean = {script for script, overrides in RECIPES.items()
             if not unimplemented(resolve_config(None, localize(overrides, tmp_path))[0])}
    assert len(clean) >= NOTHING_REFUSED
    assert {"examples/train/megatron/run_megatron.sh",  # megatron in bf16 (SkyRL's default)
            "examples/train/megatron/run_megatron_lora_qwen3-0.6b.sh",  # and with LoRA
            "examples/train/fully_async/fully_async_run_gsm8k_megatron_lora.sh",  # merge_lora=false
            "examples/train/multiply/run_multiply.sh",  # example entry points' environments
            "examples/train/llm_as_a_judge/run_llm_judge.sh",
            "examples/train/step_wise/run_skyrl_sql_step_wise.sh",  # step-wise trajectories
            "examples/train/step_wise/run_skyrl_sql_step_wise_qwen3.sh",
            "examples/train/search/run_search_fully_async.sh"} <= clean
