"""Bad input raises a clear error naming the value and the limit; the engine keeps serving."""

from __future__ import annotations

import json

import pytest
import torch

from inflight.engine import EngineConfig, InvalidRequestError, LLMEngine, ModelLoadError, SamplingParams
from inflight.engine.errors import WeightUpdateError


@pytest.fixture(scope="module")
def engine(tiny_model_factory):
    return LLMEngine(EngineConfig(model=str(tiny_model_factory("qwen2")), block_size=8, num_kv_blocks=16,
                                  max_model_len=200))


def _still_serves(engine: LLMEngine) -> None:
    out = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))[0]
    assert len(out.output_token_ids) == 3


@pytest.mark.parametrize(
    "params, needle",
    [
        (SamplingParams(max_tokens=0), "max_tokens=0"),
        (SamplingParams(temperature=-1.0), "temperature=-1.0"),
        (SamplingParams(top_p=0.0), "top_p=0.0"),
        (SamplingParams(top_p=1.5), "top_p=1.5"),
        (SamplingParams(top_k=-5), "top_k=-5"),
    ],
)
def test_invalid_sampling_values(engine, params, needle):
    engine.add_request("running", [1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True))
    with pytest.raises(InvalidRequestError, match=needle.replace(".", r"\.")):
        engine.add_request("bad", [1, 2, 3], params)
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert [o.request_id for o in outs] == ["running"] and len(outs[0].output_token_ids) == 4
    _still_serves(engine)


def test_prompt_longer_than_context(engine):
    with pytest.raises(InvalidRequestError, match="prompt has 200 tokens; the context holds 200"):
        engine.add_request("long", [1] * 200)
    _still_serves(engine)


def test_request_that_never_fits_the_cache(engine):
    with pytest.raises(
        InvalidRequestError, match=r"needs up to 25 KV blocks \(199 tokens\) but the cache has 16"
    ):
        engine.add_request("huge", [1] * 150, SamplingParams(max_tokens=49))
    engine.add_request("fits", [1] * 100, SamplingParams(max_tokens=28, ignore_eos=True))  # exactly 16 blocks
    while engine.has_unfinished_requests():
        engine.step()
    _still_serves(engine)


def test_duplicate_request_id(engine):
    engine.add_request("dup", [1, 2], SamplingParams(max_tokens=2, ignore_eos=True))
    with pytest.raises(InvalidRequestError, match="'dup' is already in use"):
        engine.add_request("dup", [3, 4])
    while engine.has_unfinished_requests():
        engine.step()
    engine.add_request("dup", [3, 4], SamplingParams(max_tokens=1))  # free again once finished
    while engine.has_unfinished_requests():
        engine.step()


def test_token_ids_outside_vocabulary(engine):
    with pytest.raises(InvalidRequestError, match=r"\[100000\] are outside the vocabulary"):
        engine.add_request("oov", [1, 100000])
    with pytest.raises(InvalidRequestError, match="empty"):
        engine.add_request("empty", [])
    _still_serves(engine)


def test_missing_files_and_unknown_architecture(tmp_path, tiny_model_factory):
    with pytest.raises(ModelLoadError, match="does not exist"):
        LLMEngine(EngineConfig(model=str(tmp_path / "nope")))
    with pytest.raises(ModelLoadError, match="no config.json"):
        LLMEngine(EngineConfig(model=str(tmp_path)))
    src = tiny_model_factory("qwen2")
    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    (no_weights / "config.json").write_text((src / "config.json").read_text())
    with pytest.raises(ModelLoadError, match="no \\*.safetensors"):
        LLMEngine(EngineConfig(model=str(no_weights)))
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(
        json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]})
    )
    with pytest.raises(ModelLoadError, match="unsupported architecture.*GPT2LMHeadModel.*Qwen2ForCausalLM"):
        LLMEngine(EngineConfig(model=str(gpt2)))


def test_invalid_engine_config_lists_every_problem(tiny_model_factory):
    with pytest.raises(InvalidRequestError) as err:
        LLMEngine(EngineConfig(model=str(tiny_model_factory("qwen2")), dtype="fp8", block_size=0,
                               num_kv_blocks=-1))
    assert "dtype='fp8'" in str(err.value) and "block_size=0" in str(err.value)
    assert "num_kv_blocks=-1" in str(err.value)


@pytest.mark.parametrize(
    "make, needle",
    [
        (lambda p: torch.full_like(p, float("nan")), "holds NaN or inf"),
        (lambda p: p.clone().index_fill_(0, torch.tensor([0]), float("inf")), "holds NaN or inf"),
        (lambda p: p.round().to(torch.int64), "is int64; weights must be floating point"),
        (lambda p: p.double().index_fill_(0, torch.tensor([0]), 1e300), "holds 1e\\+300, beyond float32"),
    ],
    ids=["nan", "inf", "int64", "overflow"],
)
def test_weights_the_engine_cannot_hold_are_refused_and_the_old_ones_stay(engine, make, needle):
    """Issue 18 finding 4: a NaN update was accepted and the engine then returned token 0 forever."""
    prompt, params = [[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    before = engine.generate(prompt, params)[0]
    name, param = next(iter(engine.model.named_parameters()))
    hf_name = next(n for n in engine.model.hf_parameter_names() if engine.model.resolve(n) == name)
    version = engine.weight_version
    engine.begin_weight_update()
    with pytest.raises(WeightUpdateError, match=rf"parameter '{hf_name}' {needle}"):
        engine.load_weights([(hf_name, make(param.detach()))])
    assert engine.abort_weight_update() is True
    assert engine.weight_version == version
    after = engine.generate(prompt, params)[0]
    assert after.output_token_ids == before.output_token_ids and after.logprobs == before.logprobs
