"""The weight-sync benchmark runs end to end in its smallest form and reports each fate."""

from __future__ import annotations

from inflight.bench.common import MODEL_SHAPES
from inflight.bench.weight_sync_bench import format_table, run
from inflight.testing import make_tiny_model


def test_weight_sync_bench_reports_every_fate(tmp_path):
    model_dir = make_tiny_model(tmp_path / "m", "qwen2", seed=0, **MODEL_SHAPES["tiny"])
    results = run(str(model_dir), num_requests=3, prompt_len=20, repeats=1)
    assert set(results["fates"]) == {"keep", "offload", "recompute"}
    assert results["memcpy_s"] > 0 and results["weight_bytes"] > 0
    for fate in results["fates"].values():
        assert fate["pause_s"] > 0
    assert results["fates"]["keep"]["recomputed_tokens"] == 0
    assert results["fates"]["offload"]["recomputed_tokens"] == 0
    # recompute re-reads every prompt and the tokens sampled before the update
    assert results["fates"]["recompute"]["recomputed_tokens"] >= 3 * 20
    assert "recompute" in format_table(results)


def test_a_lora_sync_moves_the_adapter_and_the_engine_merges_it(tmp_path):
    """`--lora R`: each sync sends the adapter; the engine's weights become W0 + B A (checked
    against peft's own merge of the same adapter) and the bytes are a fraction of the model's."""
    import torch
    from transformers import AutoModelForCausalLM

    from inflight.bench.weight_sync_bench import adapter_weights
    from inflight.engine import EngineConfig, LLMEngine

    model_dir = make_tiny_model(tmp_path / "m", "qwen2", seed=0, **MODEL_SHAPES["tiny"])
    results = run(str(model_dir), num_requests=3, prompt_len=20, repeats=1, lora=4)
    assert set(results["fates"]) == {"keep", "recompute"} and results["lora_rank"] == 4
    assert 0 < results["sent_fraction"] < 0.25 and "rank-4 LoRA adapter" in format_table(results)
    adapter = dict(adapter_weights(str(model_dir), 4))
    engine = LLMEngine(EngineConfig(model=str(model_dir)))
    engine.begin_weight_update()
    engine.load_weights(adapter.items())
    engine.finish_weight_update()
    base = dict(AutoModelForCausalLM.from_pretrained(model_dir).named_parameters())
    name = "model.layers.0.mlp.down_proj.weight"
    merged = base[name].detach() + adapter[name.replace(".weight", ".lora_B.weight")] @ adapter[
        name.replace(".weight", ".lora_A.weight")]
    torch.testing.assert_close(dict(engine.model.named_parameters())[name].detach(), merged)
