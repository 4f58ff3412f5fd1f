"""The megatron worker under `trainer.bf16` (megatron's own mixed precision, as SkyRL's megatron worker
runs it): bfloat16 parameters and compute, float32 main copies that gradients accumulate into, that
AdamW steps and that checkpoints and syncs read.

Two gloo ranks (tensor parallel size 2) run one case; the oracles are `transformers` and torch:

- the logits and the gradient of a token-mean NLL sit as close to transformers' float32 ones as
  transformers' own bfloat16 model does (the reference's own bf16 error is the yardstick);
- the step is torch's AdamW (with `clip_grad_norm_`) applied to the float32 main weights with the
  gathered float32 gradient, and the model's parameters are then those weights rounded to bfloat16;
- what a sync or checkpoint reads is the float32 main weights, starting from the checkpoint exactly.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed; pip install -e '.[megatron]'")

import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from megatron_support import free_port, small_batch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from inflight.config import load_config  # noqa: E402
from inflight.megatron.convert import is_tensor_parallel, megatron_shards_to_hf  # noqa: E402
from inflight.testing import LOCAL_CPU, make_tiny_model  # noqa: E402
from inflight.train import TrainBatch  # noqa: E402
from inflight.train.losses import token_logprobs, token_mean_nll_loss  # noqa: E402

TP = 2
LR = 1e-3
MAX_GRAD_NORM = 0.5  # below the gradient's norm: the clip acts


def _cfg(model_dir: Path):
    return load_config(None, [
        *LOCAL_CPU, f"trainer.policy.model.path={model_dir}", "trainer.strategy=megatron",
        "trainer.bf16=true", f"trainer.policy.optimizer_config.lr={LR}",
        f"trainer.policy.optimizer_config.max_grad_norm={MAX_GRAD_NORM}",
        "trainer.policy.megatron_config.transformer_config_kwargs={}",  # recompute is CUDA-only
    ])  # fmt: skip


def _batch(vocab: int) -> TrainBatch:
    return small_batch(vocab, 7, 12, 1, 9)


def _main_grads_hf(worker) -> dict[str, torch.Tensor]:
    """The float32 main gradients, gathered over TP and named and laid out as HF's."""
    out = {}
    for name, main in worker.main_params.items():
        local = main.grad.contiguous()
        shards = [local]
        if is_tensor_parallel(name):
            shards = [torch.empty_like(local) for _ in range(TP)]
            dist.all_gather(shards, local, group=worker.tp_group)
        out.update(megatron_shards_to_hf(name, shards, worker.layout))
    return out


def _rank(rank: int, port: int, model_dir: Path, out: Path) -> None:
    from inflight.megatron.worker import MegatronPolicyWorker

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=TP)
    try:
        worker = MegatronPolicyWorker(_cfg(model_dir), tensor_parallel_size=TP).setup()
        batch = _batch(worker.layout.vocab_size)
        result = {"param_dtypes": {p.dtype for p in worker.model.parameters()},
                  "main_dtypes": {p.dtype for p in worker.main_params.values()},
                  "optimized": {id(p) for g in worker.optimizer.param_groups for p in g["params"]}
                  == {id(p) for p in worker.main_params.values()},
                  "logits": worker.forward_logits(batch.input_ids, batch.attention_mask),
                  "hf_before": worker.full_hf_state_dict()}
        worker.model.train()
        worker.forward_backward(batch, 1.0)
        result["model_grads_freed"] = all(p.grad is None for p in worker.model.parameters())
        worker._reduce_grads()
        result["grads"] = _main_grads_hf(worker)
        worker._reduce_grads = lambda: None  # reduced already: the step's clip must not reduce twice
        result["metrics"] = worker.optimizer_step()
        result["hf_after"] = worker.full_hf_state_dict()
        params = dict(worker.model.named_parameters())
        result["params_are_rounded_main"] = all(
            torch.equal(params[n], m.detach().to(torch.bfloat16)) for n, m in worker.main_params.items())
        worker.shutdown()
        if rank == 0:
            torch.save(result, out)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    # qwen3: qk-norm (replicated weights whose gradient sums over TP), tied embeddings, padded vocab
    return make_tiny_model(tmp_path_factory.mktemp("megatron_bf16") / "m", arch="qwen3", seed=2,
                           hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, tie_word_embeddings=True, vocab_size=381)


@pytest.fixture(scope="module")
def ranks(model_dir, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("megatron_bf16_ranks") / "rank0.pt"
    mp.spawn(_rank, args=(free_port(), model_dir, out), nprocs=TP, join=True)
    return torch.load(out, weights_only=False)


def _transformers(model_dir: Path, dtype: torch.dtype) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """transformers' logits and NLL gradient (as float32) with every parameter in `dtype`."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    batch = _batch(model.config.vocab_size)
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    token_mean_nll_loss(token_logprobs(logits, batch.input_ids), batch).backward()
    grads = {n: p.grad.float() for n, p in model.named_parameters()}
    return logits.detach().float(), grads


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).norm() / want.norm())


def test_bf16_parameters_and_float32_main_copies_that_the_optimizer_steps(ranks):
    assert ranks["param_dtypes"] == {torch.bfloat16} and ranks["main_dtypes"] == {torch.float32}
    assert ranks["optimized"] and ranks["model_grads_freed"]  # gradients live on the main copies only


def test_forward_and_gradient_are_as_close_to_float32_as_transformers_own_bf16(model_dir, ranks):
    fp32_logits, fp32_grads = _transformers(model_dir, torch.float32)
    bf16_logits, bf16_grads = _transformers(model_dir, torch.bfloat16)
    real = _batch(fp32_logits.shape[-1]).attention_mask.bool()
    yardstick = _rel(bf16_logits[real], fp32_logits[real])
    got = _rel(ranks["logits"][real], fp32_logits[real])
    assert yardstick / 4 < got < 2 * yardstick, (got, yardstick)  # bfloat16 noise, and no more
    names = [n for n in fp32_grads if n in ranks["grads"]]
    assert set(ranks["grads"]) == set(names)  # every parameter of the tied model (no lm_head)
    want = torch.cat([fp32_grads[n].flatten() for n in names])
    yardstick = _rel(torch.cat([bf16_grads[n].flatten() for n in names]), want)
    got = _rel(torch.cat([ranks["grads"][n].flatten() for n in names]), want)
    assert yardstick / 4 < got < 2 * yardstick, (got, yardstick)


def test_the_step_is_torch_adamw_on_the_float32_main_weights(model_dir, ranks):
    checkpoint = load_file(str(model_dir / "model.safetensors"))
    assert set(ranks["hf_before"]) == set(checkpoint) - {"lm_head.weight"}
    for name, tensor in ranks["hf_before"].items():  # float32 main copies: the checkpoint, unrounded
        assert tensor.dtype == torch.float32 and torch.equal(tensor, checkpoint[name]), name
    names = list(ranks["hf_before"])
    params = [torch.nn.Parameter(ranks["hf_before"][n].clone()) for n in names]
    for param, name in zip(params, names, strict=True):
        param.grad = ranks["grads"][name].clone()
    defaults = _cfg(model_dir).trainer.policy.optimizer_config
    optimizer = torch.optim.AdamW(
        params, lr=LR, betas=tuple(defaults.adam_betas), weight_decay=defaults.weight_decay
    )
    norm = float(torch.nn.utils.clip_grad_norm_(params, MAX_GRAD_NORM))
    optimizer.step()
    assert norm > MAX_GRAD_NORM and ranks["metrics"]["grad_norm"] == pytest.approx(norm, rel=1e-5)
    for param, name in zip(params, names, strict=True):
        torch.testing.assert_close(
            ranks["hf_after"][name], param.detach(), rtol=1e-6, atol=LR * 1e-4, msg=name
        )
    assert ranks["params_are_rounded_main"]
