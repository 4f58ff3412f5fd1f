"""A mixture-of-experts policy's weights through the one weight path: a full sync (the trainer's fused
3-D expert tensors by their HF names), a LoRA sync (peft's adapters on attention, the expert weights
and the router), and the HF export, which transformers' `from_pretrained` and the engine both load.
Oracles: transformers (the trainer's model, `from_pretrained`) and peft (`merge_and_unload`)."""

from __future__ import annotations

import asyncio
import copy

import numpy as np
import pytest
import torch
from tolerance import assert_close_to_reference, other_thread_count
from transformers import AutoModelForCausalLM

from inflight.client import LocalClient
from inflight.config import ConfigError, load_config
from inflight.engine import AsyncEngine, EngineConfig, LLMEngine, SamplingParams
from inflight.testing import LOCAL_CPU, make_tiny_model
from inflight.train.batch import TrainBatch
from inflight.train.checkpoint import export_model
from inflight.train.lora import adapter_tensors, merged_tensors
from inflight.train.workers.local import LocalPolicyWorker
from inflight.weight_sync.plan import plan_weight_sync

peft = pytest.importorskip("peft")

PROMPTS = [[5, 9, 200, 31, 8, 77], list(range(40, 52))]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """Qwen2-MoE: routed experts, the gated shared expert and a dense layer (decoder_sparse_step=2)."""
    return make_tiny_model(tmp_path_factory.mktemp("qwen2moe"), "qwen2_moe", num_hidden_layers=3,
                           decoder_sparse_step=2)


@pytest.fixture(scope="module")
def qwen3_moe_dir(tmp_path_factory):
    """Qwen3-MoE, every layer sparse (as published Qwen3-MoE checkpoints are)."""
    return make_tiny_model(tmp_path_factory.mktemp("qwen3moe"), "qwen3_moe", num_hidden_layers=2)


def _worker(model_dir, *extra: str) -> LocalPolicyWorker:
    cfg = load_config(None, [*LOCAL_CPU, f"trainer.policy.model.path={model_dir}",
                             "trainer.policy.optimizer_config.lr=3e-2", *extra])
    return LocalPolicyWorker(cfg, model_path=str(model_dir)).setup()


def _train_once(worker: LocalPolicyWorker) -> None:
    ids = torch.tensor([p + [3] * (12 - len(p)) for p in PROMPTS])
    worker.train_step(
        TrainBatch(input_ids=ids, loss_mask=torch.ones(ids.shape).index_fill(1, torch.tensor([0]), 0))
    )


def _sync_then_generate(worker: LocalPolicyWorker, model_dir) -> list:
    async def main():
        engine = AsyncEngine(LLMEngine(EngineConfig(model=str(model_dir), block_size=4, num_kv_blocks=64)))
        try:
            report = await worker.sync_weights(LocalClient(engine), plan_weight_sync(worker.cfg), 1)
            assert report.ok and report.version == 1
            return [await engine.generate(p, GREEDY) for p in PROMPTS]
        finally:
            await engine.close()

    return asyncio.run(main())


def _assert_engine_is_the_trainer(outputs: list, worker: LocalPolicyWorker) -> None:
    """The engine's greedy tokens and their log-probabilities are the trainer model's (fp32), within
    what the trainer's own log-probabilities move by in float64 and on another thread count."""
    wide = copy.deepcopy(worker.model).double()
    (wide.get_base_model() if hasattr(wide, "get_base_model") else wide).set_experts_implementation("eager")
    refs, threads, doubled = [], [], []
    for prompt, out in zip(PROMPTS, outputs, strict=True):
        full = prompt + out.output_token_ids
        batch = TrainBatch(input_ids=torch.tensor([full]), loss_mask=torch.ones(1, len(full)))
        refs.append(worker.logprobs(batch)[0, len(prompt):])
        with other_thread_count():
            threads.append(worker.logprobs(batch)[0, len(prompt):])
        with torch.no_grad():
            logits = worker.model(input_ids=torch.tensor([full])).logits[0, len(prompt) - 1 : -1]
            wide_logprobs = (
                wide(input_ids=torch.tensor([full])).logits[0, len(prompt) - 1 : -1].log_softmax(-1)
            )
        doubled.append(wide_logprobs.gather(1, torch.tensor(out.output_token_ids)[:, None])[:, 0])
        assert out.output_token_ids == logits.argmax(-1).tolist()
    assert_close_to_reference(np.concatenate([out.logprobs for out in outputs]), torch.cat(refs),
                              [torch.cat(threads), torch.cat(doubled)], "engine logprobs")


def test_a_full_sync_sends_the_fused_experts_the_engine_takes(model_dir):
    worker = _worker(model_dir)
    _train_once(worker)
    names = [n for n, _ in worker.iter_sync_tensors()]
    assert "model.layers.1.mlp.experts.gate_up_proj" in names and "model.layers.1.mlp.gate.weight" in names
    _assert_engine_is_the_trainer(_sync_then_generate(worker, model_dir), worker)


@pytest.mark.parametrize("arch", ["qwen2_moe", "qwen3_moe"])
def test_lora_on_attention_experts_and_router_syncs_and_merges_as_peft(arch, request):
    """all-linear adapts the experts and the routers on both (peft alone does on Qwen3-MoE only)."""
    model_dir = request.getfixturevalue("model_dir" if arch == "qwen2_moe" else "qwen3_moe_dir")
    worker = _worker(model_dir, "trainer.policy.model.lora.rank=2", "trainer.policy.model.lora.alpha=4")
    _train_once(worker)  # B starts at 0: one step gives every adapter a delta
    sent = dict(adapter_tensors(worker.model))
    for name in (
        "model.layers.1.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj",
        "model.layers.1.mlp.gate", "model.layers.1.self_attn.q_proj",
        "model.layers.0.mlp.down_proj" if arch == "qwen2_moe" else "model.layers.0.mlp.experts.down_proj",
    ):
        assert f"{name}.lora_A.weight" in sent and f"{name}.lora_B.weight" in sent, name
    assert not any("base_layer" in n for n in sent)
    assert float(sent["model.layers.1.mlp.experts.down_proj.lora_B.weight"].abs().sum()) > 0
    merged = copy.deepcopy(worker.model).merge_and_unload()
    want = merged.state_dict()
    got = dict(merged_tensors(worker.model))
    assert sorted(got) == sorted(want)
    for name, tensor in got.items():
        torch.testing.assert_close(tensor, want[name], rtol=1e-6, atol=1e-6, msg=name)
    _assert_engine_is_the_trainer(_sync_then_generate(worker, model_dir), worker)


def _peft_skips_the_dense_mlp(model_dir) -> bool:
    """Whether peft itself, asked for all-linear, leaves layer 0's dense gate_proj without a LoRA layer."""
    import peft
    from peft.tuners.lora import LoraLayer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    adapted = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules="all-linear"))
    gate = next(m for n, m in adapted.named_modules() if n.endswith("layers.0.mlp.gate_proj"))
    return not isinstance(gate, LoraLayer)


def test_targets_peft_cannot_adapt_are_refused_naming_the_key(model_dir, tmp_path):
    with pytest.raises(ConfigError, match="lora.target_modules.*names one of gate_proj and up_proj"):
        _worker(
            model_dir,
            "trainer.policy.model.lora.rank=2",
            "trainer.policy.model.lora.target_modules=[gate_proj]",
        )
    with pytest.raises(ConfigError, match="lora.target_modules.*not found in the base model"):
        _worker(
            model_dir,
            "trainer.policy.model.lora.rank=2",
            "trainer.policy.model.lora.target_modules=[nothing]",
        )
    # peft 0.21's Qwen3-MoE conversion left the dense layer's MLP (mlp_only_layers) unadapted; later
    # peft adapts it: the refusal must follow what the installed peft does
    dense_too = make_tiny_model(tmp_path / "q3", "qwen3_moe", num_hidden_layers=2, mlp_only_layers=[0])
    if _peft_skips_the_dense_mlp(dense_too):
        with pytest.raises(ConfigError, match="without an adapter \\(e.g. model.layers.0.mlp.gate_proj\\)"):
            _worker(dense_too, "trainer.policy.model.lora.rank=2")
    else:
        assert _worker(dense_too, "trainer.policy.model.lora.rank=2").lora
    excluded = [
        "trainer.policy.model.lora.rank=2",
        "trainer.policy.model.lora.exclude_modules=[layers.0.mlp.gate_proj,"
        "layers.0.mlp.up_proj,layers.0.mlp.down_proj]",
    ]
    assert _worker(dense_too, *excluded).lora


@pytest.mark.parametrize("lora", [False, True])
def test_the_export_loads_in_transformers_and_the_engine(model_dir, tmp_path, lora):
    worker = _worker(model_dir, *(["trainer.policy.model.lora.rank=2"] if lora else []))
    _train_once(worker)
    out = export_model(worker, model_dir, tmp_path / "exports", 1)
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    model = worker.causal_lm() if not lora else copy.deepcopy(worker.model).merge_and_unload()
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], tensor, rtol=0, atol=0, msg=name)
    engine = LLMEngine(EngineConfig(model=str(out), block_size=4, num_kv_blocks=64))
    _assert_engine_is_the_trainer(engine.generate(PROMPTS, GREEDY), worker)
