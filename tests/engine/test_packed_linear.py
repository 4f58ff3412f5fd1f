"""oneDNN-packed linear layers: same results as F.linear, never stale after a weight change, used by default
on CPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from inflight.engine import EngineConfig, InvalidRequestError, LLMEngine, SamplingParams, cpu
from inflight.engine.models import linear as linear_module
from inflight.engine.models.linear import (
    FusedLinear,
    PackedLinear,
    invalidate_packed,
    onednn_available,
    resolve_linear_backend,
)
from inflight.engine.models.loader import iter_safetensors
from inflight.testing.oracle import hf_greedy

pytestmark = pytest.mark.skipif(not onednn_available(), reason="this torch build has no oneDNN")
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8, 9], list(range(20, 47))]


@pytest.fixture(autouse=True)
def always_packed(request, monkeypatch):
    """The tiny test models are below the small-matmul bound, where F.linear runs instead: lift it
    so every forward here goes through the packed copies (except in the test of that bound)."""
    if "small_matmuls" not in request.node.name:
        monkeypatch.setattr(linear_module, "_SMALL_ROWS", 0)


def _packed(in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
            compute: torch.dtype | None = None) -> PackedLinear:  # fmt: skip
    linear = PackedLinear(in_features, out_features, bias=bias).to(dtype)
    linear.use_packed(compute or dtype)
    return linear


def _packings() -> list:
    """(weight dtype, compute dtype) pairs: each dtype packed as itself, and bfloat16 computed in
    float32 (what CPUs without AVX-512 run); bfloat16 packing is skipped where oneDNN refuses it."""
    ok, why = cpu.onednn_packing(torch.bfloat16)
    bf16 = pytest.param(
        torch.bfloat16,
        torch.bfloat16,
        id="bf16",
        marks=[] if ok else pytest.mark.skip(reason=f"oneDNN refuses bf16 on this CPU: {why}"),
    )
    return [pytest.param(torch.float32, torch.float32, id="fp32"), bf16,
            pytest.param(torch.bfloat16, torch.float32, id="bf16-in-fp32")]  # fmt: skip


@pytest.mark.parametrize(("dtype", "compute"), _packings())
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_packed_equals_f_linear(dtype, compute, bias, rows):
    torch.manual_seed(rows)
    linear = _packed(96, 160, bias, dtype, compute)
    x = torch.randn(rows, 96, dtype=dtype)
    with torch.inference_mode():
        got, want = linear(x), F.linear(x, linear.weight, linear.bias)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert got.dtype == dtype and got.shape == (rows, 160)
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


def test_leading_dimensions_are_kept():
    linear = _packed(32, 48, True, torch.float32)
    x = torch.randn(2, 3, 32)
    with torch.inference_mode():
        torch.testing.assert_close(linear(x), F.linear(x, linear.weight, linear.bias), atol=1e-5, rtol=1e-5)


def test_small_matmuls_take_f_linear_and_large_ones_the_packed_weight():
    small = _packed(128, 128, False, torch.float32)
    with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU]) as prof:
        small(torch.randn(8, 128))
    assert "mkldnn::_linear_pointwise" not in {e.key for e in prof.key_averages()}
    small_bf16 = _packed(128, 128, False, torch.bfloat16, torch.float32)  # bf16 F.linear is no faster
    for linear, rows in ((small, 64), (_packed(512, 512, False, torch.float32), 1), (small_bf16, 8)):
        with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU]) as prof:
            linear(torch.randn(rows, linear.in_features, dtype=linear.weight.dtype))
        assert "mkldnn::_linear_pointwise" in {e.key for e in prof.key_averages()}


def test_in_place_weight_change_repacks():
    linear = _packed(32, 48, False, torch.float32)
    x = torch.randn(4, 32)
    with torch.inference_mode():
        linear(x)  # packs the first weight
    with torch.no_grad():
        linear.weight.copy_(torch.randn(48, 32))
    with torch.inference_mode():
        torch.testing.assert_close(linear(x), x @ linear.weight.T, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("dtype", "compute"), _packings())
@pytest.mark.parametrize("biases", [(True, True, True), (False, False, False), (True, False, True)])
def test_fused_linear_equals_its_parts(dtype, compute, biases):
    torch.manual_seed(0)
    parts = [
        _packed(64, width, bias, dtype, compute) for width, bias in zip((64, 32, 32), biases, strict=True)
    ]
    fused = FusedLinear(parts)
    x = torch.randn(9, 64, dtype=dtype)
    with torch.inference_mode():
        outs = fused(x)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for out, part in zip(outs, parts, strict=True):
        torch.testing.assert_close(out, F.linear(x, part.weight, part.bias), atol=tol, rtol=tol)


def test_fused_linear_follows_every_part():
    parts = [_packed(32, 16, True, torch.float32) for _ in range(2)]
    fused, x = FusedLinear(parts), torch.randn(4, 32)
    with torch.inference_mode():
        fused(x)
    with torch.no_grad():
        parts[1].bias.add_(1.0)  # only the second part's bias moves
    with torch.inference_mode():
        torch.testing.assert_close(
            fused(x)[1], F.linear(x, parts[1].weight, parts[1].bias), atol=1e-5, rtol=1e-5
        )
    parts[0].weight.data = torch.randn(16, 32)  # new storage
    invalidate_packed(torch.nn.ModuleList(parts))
    with torch.inference_mode():
        torch.testing.assert_close(
            fused(x)[0], F.linear(x, parts[0].weight, parts[0].bias), atol=1e-5, rtol=1e-5
        )


def _ops(engine: LLMEngine) -> set[str]:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        engine.generate([PROMPTS[0]], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    return {event.key for event in prof.key_averages()}


def test_engine_uses_packed_linears_by_default_on_cpu(tiny_model_factory):
    model_dir = str(tiny_model_factory("qwen2"))
    packed = LLMEngine(EngineConfig(model=model_dir, block_size=4))
    plain = LLMEngine(EngineConfig(model=model_dir, block_size=4, linear_backend="torch"))
    assert packed.linear_backend == "onednn" and plain.linear_backend == "torch"
    assert "mkldnn::_linear_pointwise" in _ops(packed)
    plain_ops = _ops(plain)
    assert "mkldnn::_linear_pointwise" not in plain_ops and "aten::linear" in plain_ops


def test_back_to_back_updates_without_a_step_serve_the_last_weights(tiny_model_factory, hf_model_factory):
    """Packed copies follow every update even when no forward ran between them (freed storage is
    often handed to the next update at the same address)."""
    dirs = [tiny_model_factory("qwen2", seed=s) for s in (0, 1, 2, 3)]
    engine = LLMEngine(EngineConfig(model=str(dirs[0]), block_size=4))
    engine.generate(PROMPTS, GREEDY)  # packs the first weights
    for model_dir in dirs[1:]:
        engine.pause("keep")
        engine.begin_weight_update()
        engine.load_weights(iter_safetensors(model_dir))
        engine.finish_weight_update()
        engine.resume()
    hf_last = hf_model_factory(dirs[-1])
    for prompt, out in zip(PROMPTS, engine.generate(PROMPTS, GREEDY), strict=True):
        assert out.output_token_ids == hf_greedy(hf_last, prompt, 12)[0]


def test_sleep_frees_packed_copies_and_wake_plus_update_serves_new_weights(
    tiny_model_factory, hf_model_factory
):
    model_a, model_b = tiny_model_factory("qwen2", seed=0), tiny_model_factory("qwen2", seed=1)
    engine = LLMEngine(EngineConfig(model=str(model_a), block_size=4))
    engine.generate(PROMPTS, GREEDY)
    modules = list(engine.model.modules())
    holders = [m for m in modules if isinstance(m, PackedLinear)] + [
        f for m in modules for f in getattr(m, "fused_linears", ())
    ]
    packed = [h for h in holders if h.packed_weights.packed is not None]
    assert {type(h).__name__ for h in packed} == {
        "PackedLinear",
        "FusedLinear",
    }  # o/down/lm_head and q|k|v, gate|up
    engine.sleep()
    assert all(h.packed_weights.packed is None for h in holders)
    engine.wake_up()
    engine.begin_weight_update()
    engine.load_weights(iter_safetensors(model_b))
    engine.finish_weight_update()
    hf_b = hf_model_factory(model_b)
    for prompt, out in zip(PROMPTS, engine.generate(PROMPTS, GREEDY), strict=True):
        assert out.output_token_ids == hf_greedy(hf_b, prompt, 12)[0]


def test_rollback_serves_the_old_weights_again(tiny_model_factory, hf_model_factory):
    model_a, model_b = tiny_model_factory("qwen2", seed=0), tiny_model_factory("qwen2", seed=1)
    engine = LLMEngine(EngineConfig(model=str(model_a), block_size=4))
    engine.generate(PROMPTS, GREEDY)
    engine.pause("keep")
    engine.begin_weight_update()
    engine.load_weights(iter_safetensors(model_b))
    engine.runner.model(torch.tensor([5]), torch.tensor([0]), _no_kv_meta(engine), engine.kv_cache)  # packs B
    assert engine.abort_weight_update() is True
    engine.resume()
    hf_a = hf_model_factory(model_a)
    for prompt, out in zip(PROMPTS, engine.generate(PROMPTS, GREEDY), strict=True):
        assert out.output_token_ids == hf_greedy(hf_a, prompt, 12)[0]


def _no_kv_meta(engine: LLMEngine):
    from inflight.engine.attention import PrefillChunk, build_metadata

    block = engine.pool.num_blocks - 1  # the last block: a scratch slot for this one-token forward
    return build_metadata([block * engine.config.block_size], [], [], [PrefillChunk(0, 1, 1)], [[block]],
                          engine.config.block_size, engine.device)  # fmt: skip


def test_config_names_bad_linear_backend(tiny_model_factory):
    with pytest.raises(InvalidRequestError, match="linear_backend='fast'"):
        LLMEngine(EngineConfig(model=str(tiny_model_factory("qwen2")), linear_backend="fast"))
    with pytest.raises(InvalidRequestError, match="linear_backend='onednn'.*float16"):
        LLMEngine(
            EngineConfig(model=str(tiny_model_factory("qwen2")), dtype="float16", linear_backend="onednn")
        )
    with pytest.raises(InvalidRequestError, match="linear_backend='onednn_fp32'.*for bfloat16 weights"):
        LLMEngine(EngineConfig(model=str(tiny_model_factory("qwen2")), linear_backend="onednn_fp32"))


def test_bf16_packed_in_its_own_dtype_where_onednn_runs_it_else_in_float32(tiny_model_factory):
    """auto never picks a path this CPU cannot run; the bf16-in-fp32 copy multiplies in float32."""
    engine = LLMEngine(EngineConfig(model=str(tiny_model_factory("qwen2")), dtype="bfloat16", block_size=4))
    native_bf16 = cpu.onednn_packing(torch.bfloat16)[0]
    assert engine.linear_backend == ("onednn" if native_bf16 else "onednn_fp32")
    engine.generate([PROMPTS[0]], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    packed = engine.model.lm_head.packed_weights.packed
    assert packed.dtype == (torch.bfloat16 if native_bf16 else torch.float32)


_AVX2_ONLY = {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}


def test_on_a_cpu_where_onednn_refuses_bf16_auto_computes_in_fp32_and_onednn_names_why(tiny_model_factory):
    """The AVX2-only CPU (Zen 3) case, reproduced here by capping oneDNN's ISA in a fresh process:
    oneDNN then refuses bf16 packing exactly as on that CPU. auto picks onednn_fp32 and matches
    transformers' bf16 next token; an explicit onednn names oneDNN's reason and what to use."""
    import json
    import os
    import subprocess
    import sys

    script = f"""
import json, torch
from transformers import AutoModelForCausalLM
from inflight.engine import EngineConfig, InvalidRequestError, LLMEngine, SamplingParams
model = {str(tiny_model_factory("qwen2"))!r}
engine = LLMEngine(EngineConfig(model=model, dtype="bfloat16", block_size=4))
out = engine.generate([{PROMPTS[1]!r}], SamplingParams(max_tokens=1, temperature=0.0))[0]
hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16).eval()
with torch.no_grad():
    ref = hf(torch.tensor([{PROMPTS[1]!r}])).logits[0, -1].float().log_softmax(-1)
try:
    LLMEngine(EngineConfig(model=model, dtype="bfloat16", linear_backend="onednn"))
    error = None
except InvalidRequestError as exc:
    error = str(exc)
print(json.dumps(dict(backend=engine.linear_backend, logprob=out.logprobs[0],
                      ref=ref[out.output_token_ids[0]].item(), top=ref.max().item(), error=error)))
"""
    env = {**os.environ, **_AVX2_ONLY}
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["backend"] == "onednn_fp32"
    assert abs(got["logprob"] - got["ref"]) < 0.1 and got["ref"] > got["top"] - 0.1
    assert "avx512bw" in got["error"] and "'onednn_fp32'" in got["error"]


def test_resolve_linear_backend_on_cpu():
    cpu_device = torch.device("cpu")
    assert resolve_linear_backend("auto", torch.float32, cpu_device) == "onednn"
    assert resolve_linear_backend("auto", torch.float16, cpu_device) == "torch"
    assert resolve_linear_backend("onednn_fp32", torch.bfloat16, cpu_device) == "onednn_fp32"
