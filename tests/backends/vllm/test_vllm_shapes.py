"""A model whose head size vLLM's CPU attention lacks is refused before vLLM starts (it was found at
the first request: "HTTP 500: EngineCore encountered an issue"), with the head size, the sizes vLLM
takes and the fix; the sizes are vLLM's own (`CPUAttentionBackend.get_supported_head_sizes()`)."""

from __future__ import annotations

import ast
import subprocess
import sys

import pytest
from vllm_launch import vllm_python_or_skip

from inflight.backends.vllm.shapes import CPU_HEAD_SIZES, cpu_attention_problem


@pytest.mark.parametrize(("arch", "shape", "size"), [
    ("qwen2", dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2), 16),
    ("qwen2", dict(hidden_size=64, num_attention_heads=2, num_key_value_heads=1), None),
    ("qwen3", dict(hidden_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=48), 48),
    ("llama", dict(hidden_size=256, num_attention_heads=2, num_key_value_heads=1), None),
])
def test_the_rule_reads_the_head_size_from_config_json(tiny_model_factory, arch, shape, size):
    problem = cpu_attention_problem(
        tiny_model_factory(arch, 0, **shape, intermediate_size=64, num_hidden_layers=1)
    )
    if size is None:
        assert problem is None
        return
    assert (
        f"its head size is {size} (" in problem
        and "32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512" in problem
    )
    assert ("head_dim in config.json" in problem) == (arch == "qwen3")


def test_a_missing_config_is_no_verdict(tmp_path):
    assert cpu_attention_problem(tmp_path) is None  # a missing model is refused elsewhere, by name


@pytest.mark.vllm
def test_the_sizes_are_vllms_own():
    out = subprocess.run([vllm_python_or_skip(), "-c", "from vllm.v1.attention.backends.cpu_attn import "
                          "CPUAttentionBackend as B; print(B.get_supported_head_sizes())"],
                         capture_output=True, text=True, timeout=300, check=True)
    assert tuple(ast.literal_eval(out.stdout.strip().splitlines()[-1])) == CPU_HEAD_SIZES


@pytest.mark.vllm
def test_the_server_refuses_such_a_model_before_vllm_starts(tiny_model_factory):
    model = tiny_model_factory("qwen2", 0, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                               intermediate_size=64, num_hidden_layers=1)
    proc = subprocess.run([sys.executable, "-m", "inflight.server", "--backend", "vllm", "--vllm-python",
                           vllm_python_or_skip(), "--model", str(model), "--threads", "1"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "its head size is 16" in proc.stderr and "backend=native" in proc.stderr, proc.stderr[-2000:]
    assert "Initializing a V1 LLM engine" not in proc.stderr  # refused before vLLM read the model


def test_a_run_on_vllm_refuses_such_a_model_before_it_starts(tiny_model_factory, monkeypatch):
    from inflight.backends.vllm.run_checks import run_problems
    from inflight.config import load_config
    from inflight.testing import LOCAL_CPU

    monkeypatch.setenv("INFLIGHT_VLLM_PYTHON", sys.executable)  # vLLM's python is not what this checks
    narrow = tiny_model_factory("qwen2", 0, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                intermediate_size=64, num_hidden_layers=1)
    vllm = [
        "generator.inference_engine.backend=vllm",
        "generator.inference_engine.weight_sync_backend=inprocess",
    ]
    (problem,) = run_problems(load_config(None, [*LOCAL_CPU, *vllm, f"trainer.policy.model.path={narrow}"]))
    assert problem.key == "generator.inference_engine.backend" and "its head size is 16" in problem.rule
    assert "backend=native" in problem.fix
    wide = tiny_model_factory("qwen2", 0, hidden_size=64, num_attention_heads=2, num_key_value_heads=1,
                              intermediate_size=64, num_hidden_layers=1)
    assert run_problems(load_config(None, [*LOCAL_CPU, *vllm, f"trainer.policy.model.path={wide}"])) == []
    # native
    assert run_problems(load_config(None, [*LOCAL_CPU, f"trainer.policy.model.path={narrow}"])) == []
