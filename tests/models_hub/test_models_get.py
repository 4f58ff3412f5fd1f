"""`inflight models get smollm2-135m-instruct` on the real model: the directory it writes is what
transformers and our engine serve, the bfloat16 one is the float32 one rounded, and a second call
finds the cache without doing any work."""

from __future__ import annotations

import hashlib
import json

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from inflight.cli import main as cli_main
from inflight.engine import EngineConfig, LLMEngine, SamplingParams
from inflight.models_hub import get_models, read_manifest
from inflight.models_hub.registry import lookup

NAME = "smollm2-135m-instruct"

CHAT_PROMPTS = ["What is the capital of France?", "Write one sentence about the sea.", "What is 3 times 4?"]


def _chat(tokenizer, prompt: str) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def _hf_greedy(model, ids: list[int], new_tokens: int) -> list[int]:
    x = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new_tokens, do_sample=False)
    return out[0, len(ids):].tolist()


def test_transformers_loads_it_and_it_answers_paris(smollm2):
    path = smollm2["float32"]
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    config = model.config
    assert (config.model_type, config.hidden_size, config.num_hidden_layers, config.vocab_size) == (
        "llama", 576, 30, 49152)
    assert config.tie_word_embeddings and model.dtype == torch.float32
    assert round(sum(p.numel() for p in model.parameters()) / 1e6, 1) == 134.5
    answer = tokenizer.decode(
        _hf_greedy(model, _chat(tokenizer, CHAT_PROMPTS[0]), 16), skip_special_tokens=True
    )
    assert "Paris" in answer, answer
    assert "<|im_start|>" in tokenizer.chat_template and tokenizer.eos_token == "<|im_end|>"


def test_our_engine_decodes_the_same_greedy_tokens_as_transformers(smollm2):
    path = smollm2["float32"]
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    prompts = [_chat(tokenizer, p) for p in CHAT_PROMPTS]
    engine = LLMEngine(EngineConfig(model=str(path), dtype="float32"))
    outputs = engine.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0))
    for prompt, ids, out in zip(CHAT_PROMPTS, prompts, outputs, strict=True):
        assert out.output_token_ids == _hf_greedy(model, ids, 24), prompt


def test_the_bfloat16_weights_are_the_float32_ones_rounded(smollm2):
    full = load_file(smollm2["float32"] / "model.safetensors")
    half = load_file(smollm2["bfloat16"] / "model.safetensors")
    assert full.keys() == half.keys() and len(full) > 200
    for name, tensor in full.items():
        assert tensor.dtype == torch.float32 and half[name].dtype == torch.bfloat16, name
        assert torch.equal(half[name], tensor.to(torch.bfloat16)), name
    assert json.loads((smollm2["bfloat16"] / "config.json").read_text())["dtype"] == "bfloat16"


def test_the_manifest_names_the_source_and_the_check(smollm2, smollm2_site):
    model = lookup(NAME)
    source = smollm2_site / model.module_dir / model.gguf_file
    for dtype, path in smollm2.items():
        manifest = read_manifest(path)
        assert manifest["dtype"] == dtype and manifest["source"]["file"] == str(source)
        assert manifest["source"]["sha256"] == hashlib.sha256(source.read_bytes()).hexdigest()
        assert manifest["check"]["passed"]
    check = read_manifest(smollm2["float32"])["check"]
    assert check["greedy_tokens_equal"] and check["max_relative_logit_diff"] <= check["rtol"]
    assert "Paris" in check["greedy_answers"]["What is the capital of France?"]


def test_a_second_call_finds_the_cache_and_does_nothing(smollm2, capsys):
    manifests = {d: (p / "inflight-model.json").stat().st_mtime_ns for d, p in smollm2.items()}
    said: list[str] = []
    assert get_models(NAME, say=said.append) == smollm2
    assert said == []  # no install, no dequantization, no check
    assert cli_main(["models", "get", NAME]) == 0
    printed = capsys.readouterr()
    assert printed.out.splitlines() == [f"{d}: {p}" for d, p in smollm2.items()]
    assert "inflight models:" not in printed.err
    assert {d: (p / "inflight-model.json").stat().st_mtime_ns for d, p in smollm2.items()} == manifests
