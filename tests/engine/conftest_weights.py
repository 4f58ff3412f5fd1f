"""Shared helpers for the weight-update, pause and sleep/wake tests (imported explicitly).

Two tiny Qwen2 checkpoints with the same architecture and different seeds (model A, the engine's
initial weights, and model B, the update), their Hugging Face `transformers` twins as the oracle, and
greedy decoders over a `DynamicCache` that can switch models mid-sequence: that is how a request
frozen across an update must continue when it keeps (or offloads) the KV that model A computed.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, DynamicCache

from inflight.engine import EngineConfig, LLMEngine, SamplingParams
from inflight.testing import make_tiny_model

VOCAB = 384
SMALL = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=VOCAB,
)


@dataclass
class TinyModels:
    """Model A and model B: directories, HF oracles and HF-named state dicts."""

    dir_a: Path
    dir_b: Path
    hf_a: torch.nn.Module
    hf_b: torch.nn.Module
    weights_a: dict[str, torch.Tensor]
    weights_b: dict[str, torch.Tensor]


_CACHE: dict[tuple, TinyModels] = {}


def tiny_models(tmp_path_factory, **overrides) -> TinyModels:
    """Build (once per process and `overrides`) model A (seed 0) and model B (seed 1)."""
    config = {**SMALL, **overrides}
    key = tuple(sorted(config.items()))
    if key not in _CACHE:
        root = tmp_path_factory.mktemp("tiny_models")
        dir_a = make_tiny_model(root / "a", arch="qwen2", seed=0, **config)
        dir_b = make_tiny_model(root / "b", arch="qwen2", seed=1, **config)
        _CACHE[key] = TinyModels(
            dir_a,
            dir_b,
            _hf(dir_a),
            _hf(dir_b),
            load_file(str(dir_a / "model.safetensors")),
            load_file(str(dir_b / "model.safetensors")),
        )
    return _CACHE[key]


def _hf(path: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def make_engine(models: TinyModels, **overrides) -> LLMEngine:
    """An engine on model A (float32, CPU); `overrides` go into EngineConfig."""
    chunked = overrides.get("enable_chunked_prefill", True)
    config = dict(
        model=str(models.dir_a),
        device="cpu",
        dtype="float32",
        block_size=4,
        num_kv_blocks=64,
        max_num_seqs=16,
        max_model_len=128,
        max_num_batched_tokens=8 if chunked else 128,
        enable_prefix_caching=True,
        enable_chunked_prefill=True,
        seed=0,
    )
    config.update(overrides)
    return LLMEngine(EngineConfig(**config))


def greedy_params(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def prompt(length: int, seed: int) -> list[int]:
    """A reproducible random prompt of `length` token ids (no special tokens)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (length,), generator=gen).tolist()


def update_weights(
    engine: LLMEngine, weights: dict[str, torch.Tensor], chunks: int = 2, version: int | None = None
) -> int:
    """A complete weight update in `chunks` load_weights calls; returns the new version."""
    engine.begin_weight_update()
    for part in split(weights, chunks):
        engine.load_weights(part)
    return engine.finish_weight_update(version)


def split(weights: dict[str, torch.Tensor], chunks: int) -> list[list[tuple[str, torch.Tensor]]]:
    items = sorted(weights.items())
    return [items[i::chunks] for i in range(chunks)]


@torch.no_grad()
def hf_continue(
    kv_model: torch.nn.Module, model: torch.nn.Module, tokens: list[int], num_cached: int, max_new: int
) -> list[int]:
    """`kv_model` computes the KV of tokens[:num_cached]; `model` reads tokens[num_cached:] over
    that cache and then decodes `max_new` tokens greedily. Returns the new tokens."""
    assert 0 <= num_cached < len(tokens)
    cache = DynamicCache(config=model.config)
    if num_cached:
        kv_model(torch.tensor([tokens[:num_cached]]), cache=cache, use_cache=True)
    logits = model(torch.tensor([tokens[num_cached:]]), cache=cache, use_cache=True).logits
    out: list[int] = []
    while True:
        out.append(int(logits[0, -1].argmax()))
        if len(out) == max_new:
            return out
        logits = model(torch.tensor([[out[-1]]]), cache=cache, use_cache=True).logits


def hf_greedy(model: torch.nn.Module, tokens: list[int], max_new: int) -> list[int]:
    """Greedy continuation of `tokens` with one model reading the whole sequence."""
    return hf_continue(model, model, tokens, 0, max_new)


def run_to_completion(engine: LLMEngine, max_steps: int = 1000) -> dict[str, object]:
    """Step until nothing is unfinished; returns the outputs by request id (each seen once)."""
    outputs: dict[str, object] = {}
    for _ in range(max_steps):
        for out in engine.step():
            assert out.request_id not in outputs, f"{out.request_id} was output twice"
            outputs[out.request_id] = out
        if not engine.has_unfinished_requests():
            return outputs
    raise AssertionError(f"requests still unfinished after {max_steps} steps")


def held_block_ids(engine: LLMEngine) -> dict[str, list[int]]:
    return {rid: list(r.block_ids) for rid, r in engine.requests.items()}


@torch.no_grad()
def hf_next_token(models_by_tag: dict[str, torch.nn.Module], tokens: list[int], provenance: list[str]) -> int:
    """The greedy next token after `tokens` when the KV of position p was computed by
    `models_by_tag[provenance[p]]` (runs of one tag are fed in order over one DynamicCache); the
    last position's model also produces the logits."""
    assert len(provenance) == len(tokens)
    cache = DynamicCache(config=next(iter(models_by_tag.values())).config)
    start = 0
    while start < len(tokens):
        end = start
        while end < len(tokens) and provenance[end] == provenance[start]:
            end += 1
        logits = models_by_tag[provenance[start]](
            torch.tensor([tokens[start:end]]), cache=cache, use_cache=True
        ).logits
        start = end
    return int(logits[0, -1].argmax())
