"""Precision and memory options of the transformers-based workers, checked against plain
`transformers` (and torch autograd): gradient checkpointing changes nothing in float32; bf16 runs
the compute in bfloat16 and keeps float32 master weights and optimizer state."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from inflight.config import load_config
from inflight.testing import LOCAL_CPU
from inflight.train import LocalPolicyWorker, TrainBatch
from inflight.train.losses import token_logprobs


def _batch(vocab: int, rows: int = 3, length: int = 12, seed: int = 0) -> TrainBatch:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (rows, length), generator=g)
    mask = torch.ones(rows, length, dtype=torch.long)
    mask[1, 9:] = 0  # a shorter row: padding inside the batch
    loss_mask = mask.clone()
    loss_mask[:, :3] = 0
    return TrainBatch(input_ids=ids, attention_mask=mask, loss_mask=loss_mask)


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory):
    return tiny_model_factory("qwen2", seed=3)


def _worker(model_dir, **options) -> LocalPolicyWorker:
    cfg = load_config(None, [*LOCAL_CPU, "trainer.policy.optimizer_config.weight_decay=0.0"])
    return LocalPolicyWorker(cfg, model_path=str(model_dir), **options).setup()


def _vocab(model_dir) -> int:
    return AutoModelForCausalLM.from_pretrained(str(model_dir)).config.vocab_size


def test_gradient_checkpointing_equals_the_plain_transformers_forward_and_backward(model_dir):
    batch = _batch(_vocab(model_dir))
    reference = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    reference.train()
    logits = reference(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    expected = token_logprobs(logits, batch.input_ids)
    (expected * batch.loss_mask).sum().backward()

    worker = _worker(model_dir, gradient_checkpointing=True)
    assert worker.model.is_activation_checkpointing
    worker.model.train()
    got = worker.compute_logprobs(batch)
    (got * batch.loss_mask).sum().backward()
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)
    ref_grads = dict(reference.named_parameters())
    for name, param in worker.model.named_parameters():
        torch.testing.assert_close(param.grad, ref_grads[name].grad, atol=1e-6, rtol=1e-5, msg=name)


def test_bf16_computes_in_bfloat16_over_float32_master_weights(model_dir):
    batch = _batch(_vocab(model_dir))
    fp32 = _worker(model_dir)
    bf16 = _worker(model_dir, bf16=True)
    seen: list[torch.dtype] = []
    hook = bf16.model.model.layers[0].mlp.register_forward_hook(lambda m, i, out: seen.append(out.dtype))
    bf16.model.train()
    logprobs = bf16.compute_logprobs(batch)
    hook.remove()
    assert seen == [torch.bfloat16] and logprobs.dtype == torch.float32
    torch.testing.assert_close(logprobs, fp32.logprobs(batch), atol=0.1, rtol=0)  # bf16's 8-bit mantissa

    before = {n: p.detach().clone() for n, p in bf16.model.named_parameters()}
    metrics = bf16.train_step(batch)
    assert metrics["grad_norm"] > 0
    assert all(p.dtype == torch.float32 for p in bf16.model.parameters())
    state = [s for s in bf16.optimizer.state.values()]
    assert state and all(s["exp_avg"].dtype == torch.float32 for s in state)
    moved = [n for n, p in bf16.model.named_parameters() if not torch.equal(p.detach(), before[n])]
    assert len(moved) == len(before)  # every master weight took the (float32) update


def test_megatron_runs_bf16():  # tests/train/test_megatron_bf16.py checks what it does
    from inflight.config.implemented import unimplemented

    cfg = load_config(None, [*LOCAL_CPU, "trainer.strategy=megatron", "trainer.bf16=true",
                             "trainer.gradient_checkpointing=true"])
    assert unimplemented(cfg) == []


def test_the_config_keys_reach_the_worker(model_dir):
    cfg = load_config(None, [*LOCAL_CPU, "trainer.bf16=true", "trainer.gradient_checkpointing=true"])
    worker = LocalPolicyWorker(cfg, model_path=str(model_dir))
    assert worker.bf16 and worker.gradient_checkpointing
    auto = LocalPolicyWorker(load_config(None, list(LOCAL_CPU)), model_path=str(model_dir))
    assert not auto.bf16 and not auto.gradient_checkpointing  # null: bf16 on CUDA only
