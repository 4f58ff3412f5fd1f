"""LoRA adapter updates: the engine merges `W0 + B @ A` into its own weights, checked against `peft`.

Oracle: `transformers` running the `peft` model with the same adapter merged (`merge_and_unload()`).
After an adapter update the engine's greedy tokens equal it; a second adapter that leaves weights
out puts them back to the base; frozen requests continue as keep and recompute predict; bad
adapters are refused and the old weights stay.
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest_weights import (
    greedy_params,
    hf_continue,
    hf_greedy,
    make_engine,
    prompt,
    run_to_completion,
    tiny_models,
)

from inflight.engine.errors import WeightUpdateError

peft = pytest.importorskip("peft")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return tiny_models(tmp_path_factory)


def adapter(base: torch.nn.Module, rank: int, targets: list[str] | str, seed: int):
    """A `peft` LoRA model over a copy of `base` with random A and B, the merged transformers model,
    and the adapter as the engine takes it (HF names, B scaled by alpha / rank)."""
    torch.manual_seed(seed)
    config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, init_lora_weights=False)
    model = peft.get_peft_model(copy.deepcopy(base), config)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, peft.tuners.lora.LoraLayer):
                module.lora_B["default"].weight.normal_(0, 0.2)
    tensors = {}
    for name, module in model.named_modules():
        if isinstance(module, peft.tuners.lora.LoraLayer) and "default" in module.lora_A:
            hf = name.removeprefix("base_model.model.")
            tensors[f"{hf}.lora_A.weight"] = module.lora_A["default"].weight.detach().clone()
            scale = module.scaling["default"]
            tensors[f"{hf}.lora_B.weight"] = module.lora_B["default"].weight.detach() * scale
    merged = copy.deepcopy(model).merge_and_unload().eval()
    return tensors, merged


def load_adapter(engine, tensors: dict[str, torch.Tensor], chunks: int = 2) -> int:
    engine.begin_weight_update()
    items = sorted(tensors.items())
    for i in range(chunks):
        engine.load_weights(items[i::chunks])
    return engine.finish_weight_update()


def _greedy(engine, tokens: list[int], n: int) -> list[int]:
    return engine.generate([tokens], greedy_params(n))[0].output_token_ids


def test_adapter_updates_equal_transformers_on_the_merged_peft_model(models):
    engine = make_engine(models)
    tokens = prompt(12, seed=3)
    first, merged_first = adapter(models.hf_a, rank=4, targets="all-linear", seed=1)
    assert all(t.shape[0] == 4 or t.shape[1] == 4 for t in first.values())
    load_adapter(engine, first)
    assert (
        _greedy(engine, tokens, 10)
        == hf_greedy(merged_first, tokens, 10)
        != hf_greedy(models.hf_a, tokens, 10)
    )
    # a second adapter on q_proj only: every other weight goes back to the base
    second, merged_second = adapter(models.hf_a, rank=2, targets=["q_proj"], seed=2)
    load_adapter(engine, second, chunks=1)
    assert engine.weight_version == 2
    assert _greedy(engine, tokens, 10) == hf_greedy(merged_second, tokens, 10)
    sent = sum(t.numel() for t in first.values())
    assert sent < 0.2 * sum(t.numel() for t in models.weights_a.values())  # the adapter, not the model


@pytest.mark.parametrize("fate", ["keep", "recompute"])
def test_frozen_requests_continue_over_an_adapter_update_as_predicted(models, fate):
    engine = make_engine(models)
    prompts = {f"r{i}": prompt(6 + 3 * i, seed=10 + i) for i in range(3)}
    for rid, tokens in prompts.items():
        engine.add_request(rid, tokens, greedy_params(12))
    for _ in range(6):
        engine.step()
    engine.pause("keep")
    seqs = {rid: r.prompt_token_ids + r.output_token_ids for rid, r in engine.requests.items()}
    cached = {rid: r.num_computed_tokens for rid, r in engine.requests.items()}
    tensors, merged = adapter(models.hf_a, rank=4, targets="all-linear", seed=5)
    if fate == "recompute":
        engine.reset_prefix_cache(reset_running_requests=True)
    load_adapter(engine, tensors)
    engine.resume()
    outputs = run_to_completion(engine)
    for rid, tokens in prompts.items():
        seq, out = seqs[rid], outputs[rid].output_token_ids
        done = len(seq) - len(tokens)
        rest = 12 - done
        expected = (hf_continue(models.hf_a, merged, seq, cached[rid], rest) if fate == "keep"
                    else hf_greedy(merged, seq, rest))
        assert out[done:] == expected, rid
        assert outputs[rid].token_weight_versions == [0] * done + [1] * rest


@pytest.mark.parametrize(
    "bad, needle",
    [
        (lambda t: {k: v for k, v in t.items() if not k.endswith("lora_B.weight") or "q_proj" not in k},
         "lacks its lora_B tensor"),
        (lambda t: {**t, "model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(4, 7)},
         r"has shape \(4, 7\), expected \[rank, "),
        (lambda t: {**t, "model.norm.lora_A.weight": torch.zeros(4, 32)}, "has no linear weight"),
        (lambda t: {**t, "model.layers.0.mlp.up_proj.lora_B.weight": torch.full((64, 4), float("nan"))},
         "holds NaN or inf"),
        (lambda t: {**t, "model.norm.weight": torch.ones(32)}, "full weights or a LoRA adapter, not both"),
    ],
    ids=["missing-B", "shape", "not-linear", "nan", "mixed"],
)
def test_bad_adapters_are_refused_and_the_old_weights_stay(models, bad, needle):
    engine = make_engine(models)
    tokens = prompt(10, seed=4)
    before = _greedy(engine, tokens, 8)
    tensors, _ = adapter(models.hf_a, rank=4, targets="all-linear", seed=6)
    with pytest.raises(WeightUpdateError, match=needle):
        load_adapter(engine, bad(tensors), chunks=1)
    assert engine.abort_weight_update() is True
    assert engine.weight_version == 0 and _greedy(engine, tokens, 8) == before


def test_a_full_update_after_adapters_is_the_new_base(models):
    engine = make_engine(models)
    tokens = prompt(9, seed=8)
    tensors, _ = adapter(models.hf_a, rank=4, targets="all-linear", seed=7)
    load_adapter(engine, tensors)
    engine.begin_weight_update()
    engine.load_weights(models.weights_b.items())
    engine.finish_weight_update()
    assert not engine.adapters.base  # the copies of model A's weights are gone
    second, merged = adapter(models.hf_b, rank=2, targets=["v_proj", "down_proj"], seed=9)
    load_adapter(engine, second)
    assert _greedy(engine, tokens, 8) == hf_greedy(merged, tokens, 8)


def test_an_adapter_is_refused_once_sleep_dropped_the_weights(models):
    engine = make_engine(models)
    tokens = prompt(9, seed=11)
    tensors, merged = adapter(models.hf_a, rank=4, targets="all-linear", seed=12)
    engine.sleep(offload_kv=True)
    engine.wake_up(["weights"])
    with pytest.raises(WeightUpdateError, match="weights are incomplete .* send the full weights"):
        load_adapter(engine, tensors)
    assert engine.weight_version == 0
    engine.begin_weight_update()  # what a LoRA policy sends to a sleeping engine: its merged weights
    engine.load_weights(merged.state_dict().items())
    engine.finish_weight_update()
    engine.wake_up(["kv_cache"])
    assert _greedy(engine, tokens, 8) == hf_greedy(merged, tokens, 8)
