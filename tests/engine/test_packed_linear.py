"""oneDNN-packed linear layers: same results as F.linear, never stale after a weight change, used by default on CPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from inflight.engine import EngineConfig, InvalidRequestError, LLMEngine, SamplingParams
from inflight.engine.models import linear as linear_module
from inflight.engine.models.linear import FusedLinear, PackedLinear, invalidate_packed, onednn_available
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


def _packed(in_features: int, out_features: int, bias: bool, dtype: torch.dtype) -> PackedLinear:
    linear = PackedLinear(in_features, out_features, bias=bias).to(dtype)
    linear.use_packed(True)
    return linear


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_packed_equals_f_linear(dtype, bias, rows):
    torch.manual_seed(rows)
    linear = _packed(96, 160, bias, dtype)
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
    small_bf16 = _packed(128, 128, False, torch.bfloat16)  # bf16 F.linear is no faster: always packed
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("biases", [(True, True, True), (False, False, False), (True, False, True)])
def test_fused_linear_equals_its_parts(dtype, biases):
    torch.manual_seed(0)
    parts = [_packed(64, width, bias, dtype) for width, bias in zip((64, 32, 32), biases, strict=True)]
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
    packed = [h for h in holders if h._packed is not None]
    assert {type(h).__name__ for h in packed} == {
        "PackedLinear",
        "FusedLinear",
    }  # o/down/lm_head and q|k|v, gate|up
    engine.sleep()
    assert all(h._packed is None for h in holders)
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
