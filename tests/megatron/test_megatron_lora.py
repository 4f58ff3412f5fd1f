"""LoRA on the megatron worker (SkyRL's `lora_type: lora`: one adapter per fused layer) against peft on
the transformers model, with two gloo ranks (tensor parallel size 2).

The oracle is a peft adapter on q/k/v/o/gate/up/down whose q, k and v (and gate and up) share their
A, which is exactly what megatron's fused adapters are. The test writes it with peft's
`save_pretrained`; the ranks load it (`load_adapter`, a resume), and:

- megatron's logits equal peft's;
- B's gradients equal peft's, the shared A's equals the sum of peft's over the modules sharing it;
- the step is torch's AdamW (with the clip) on the fused adapters with those gradients;
- what `save_adapter` writes loads with peft's `PeftModel.from_pretrained` and gives the trained
  model's logits; the merged weights a sync sends are peft's `merge_and_unload`; with
  merge_lora=false the sync sends the adapter (B scaled) instead;
- under bf16 (frozen base in bfloat16, adapters float32) the logits sit as close to peft's float32 ones
  as transformers' own bf16 model with the same adapter does.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed; pip install -e '.[megatron]'")
peft = pytest.importorskip("peft")

import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from megatron_support import free_port, small_batch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from inflight.config import ConfigError, load_config  # noqa: E402
from inflight.testing import LOCAL_CPU, make_tiny_model  # noqa: E402
from inflight.train import TrainBatch  # noqa: E402
from inflight.train.losses import token_logprobs, token_mean_nll_loss  # noqa: E402

TP, RANK, ALPHA, LR, MAX_NORM = 2, 4, 8, 1e-2, 0.05
HF_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SHARED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def _cfg(model_dir: Path, *extra: str):
    return load_config(None, [
        *LOCAL_CPU, f"trainer.policy.model.path={model_dir}", "trainer.strategy=megatron",
        f"trainer.policy.model.lora.rank={RANK}", f"trainer.policy.model.lora.alpha={ALPHA}",
        f"trainer.policy.optimizer_config.lr={LR}",
        f"trainer.policy.optimizer_config.max_grad_norm={MAX_NORM}",
        "trainer.policy.megatron_config.transformer_config_kwargs={}", *extra,
    ])  # fmt: skip


def _batch(vocab: int) -> TrainBatch:
    return small_batch(vocab, 5, 11, 2, 8)


def _grads_hf(worker) -> dict[str, torch.Tensor]:
    """The adapters' gradients in Hugging Face form (as `hf_adapter_tensors` gives the adapters)."""
    from inflight.megatron.lora_layers import hf_adapter

    out = {}
    for layer, adapter in worker.adapters.items():
        a, b = [adapter.A.grad.clone()], [adapter.B.grad.clone()]  # the step clips .grad in place
        split = b if adapter.column else a
        gathered = [torch.empty_like(split[0]) for _ in range(TP)]
        dist.all_gather(gathered, split[0], group=worker.tp_group)
        split[:] = gathered
        out.update(hf_adapter(layer, a, b, worker.layout))
    return out


def _rank(rank: int, port: int, model_dir: Path, adapter_dir: Path, out: Path) -> None:
    from inflight.megatron.worker import MegatronPolicyWorker

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=TP)
    try:
        worker = MegatronPolicyWorker(_cfg(model_dir), tensor_parallel_size=TP).setup()
        worker.load_adapter(adapter_dir)
        batch = _batch(worker.layout.vocab_size)
        trained = {n for n, p in worker.model.named_parameters() if p.requires_grad}
        result = {
            "trained": trained, "optimized": sum(len(g["params"]) for g in worker.optimizer.param_groups),
            "logits": worker.forward_logits(batch.input_ids, batch.attention_mask),
            "adapter_before": {n: t.clone() for n, t in worker.hf_adapter_tensors()},
        }  # not views
        worker.model.train()
        worker.forward_backward(batch, 1.0)
        result["base_grads"] = [
            n for n, p in worker.model.named_parameters() if p.grad is not None and ".lora." not in n
        ]
        result["grads"] = _grads_hf(worker)
        result["metrics"] = worker.optimizer_step()
        result["adapter_after"] = dict(worker.hf_adapter_tensors())
        worker.save_adapter(out.parent / "saved_adapter")
        result["logits_after"] = worker.forward_logits(batch.input_ids, batch.attention_mask)
        result["merged"] = dict(worker.iter_sync_tensors())  # merge_lora: SkyRL's default, true
        worker.megatron.lora_config.merge_lora = False
        result["sync_adapter"] = dict(worker.iter_sync_tensors())
        worker.shutdown()
        bf16 = MegatronPolicyWorker(_cfg(model_dir, "trainer.bf16=true"), tensor_parallel_size=TP).setup()
        bf16.load_adapter(adapter_dir)
        result["bf16_dtypes"] = {n: p.dtype for n, p in bf16.model.named_parameters()}
        result["bf16_logits"] = bf16.forward_logits(batch.input_ids, batch.attention_mask)
        bf16.shutdown()
        if rank == 0:
            torch.save(result, out)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    # qwen2: q/k/v biases (which LoRA leaves alone), untied lm_head
    return make_tiny_model(
        tmp_path_factory.mktemp("megatron_lora") / "m", arch="qwen2", seed=4, hidden_size=32,
        intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    )


def _peft(model_dir: Path, dtype: torch.dtype = torch.float32, adapter: Path | None = None):
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    if adapter is not None:
        return peft.PeftModel.from_pretrained(base, str(adapter), is_trainable=True)
    return peft.get_peft_model(base, peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=HF_TARGETS))


@pytest.fixture(scope="module")
def adapter_dir(model_dir, tmp_path_factory) -> Path:
    """A peft adapter with random A and B, shared A across q/k/v and gate/up (megatron's fused form)."""
    model = _peft(model_dir)
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.3)
        modules = dict(model.named_modules())
        for name, module in modules.items():
            for group in SHARED:
                if name.endswith(group[0]):
                    for other in group[1:]:
                        modules[name[: -len(group[0])] + other].lora_A["default"].weight.copy_(
                            module.lora_A["default"].weight)
    out = tmp_path_factory.mktemp("peft_adapter")
    model.save_pretrained(str(out))
    return out


@pytest.fixture(scope="module")
def ranks(model_dir, adapter_dir, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("megatron_lora_ranks") / "rank0.pt"
    mp.spawn(_rank, args=(free_port(), model_dir, adapter_dir, out), nprocs=TP, join=True)
    return {**torch.load(out, weights_only=False), "saved_adapter": out.parent / "saved_adapter"}


def _forward(model, batch: TrainBatch) -> torch.Tensor:
    return model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits


def _hf_key(peft_name: str) -> str:
    return peft_name.removeprefix("base_model.model.").replace(".default", "")


def test_only_the_adapters_train(ranks):
    assert ranks["trained"] and all(".lora." in n for n in ranks["trained"])
    assert ranks["optimized"] == len(ranks["trained"]) == 2 * 4 * 2  # A and B of 4 layers, 2 decoder layers
    assert ranks["base_grads"] == []


def test_forward_and_gradients_equal_peft_with_shared_a(model_dir, adapter_dir, ranks):
    model = _peft(model_dir, adapter=adapter_dir)
    batch = _batch(model.config.vocab_size)
    logits = _forward(model, batch)
    torch.testing.assert_close(ranks["logits"], logits.detach(), atol=1e-5, rtol=0)
    token_mean_nll_loss(token_logprobs(logits, batch.input_ids), batch).backward()
    grads = {_hf_key(n): p.grad for n, p in model.named_parameters() if ".lora_" in n}
    assert set(grads) == set(ranks["grads"])
    for name, grad in grads.items():
        group = next((g for g in SHARED if ".lora_A." in name and name.split(".")[-3] in g), None)
        want = grad if group is None else sum(grads[name.replace(name.split(".")[-3], m)] for m in group)
        # float32 sums in another order (TP's halves): a few ulps of the gradient's largest entry
        torch.testing.assert_close(
            ranks["grads"][name], want, atol=2e-5 * float(want.abs().max()), rtol=0, msg=name
        )


def test_the_step_is_adamw_on_the_fused_adapters(ranks, model_dir):
    before, grads, after = ranks["adapter_before"], ranks["grads"], ranks["adapter_after"]
    fused = [n for n in before if not any(f".{m}.lora_A" in n for g in SHARED for m in g[1:])]  # one shared A
    params = [torch.nn.Parameter(before[n].clone()) for n in fused]
    for param, name in zip(params, fused, strict=True):
        param.grad = grads[name].clone()
    opt = _cfg(model_dir).trainer.policy.optimizer_config
    optimizer = torch.optim.AdamW(params, lr=LR, betas=tuple(opt.adam_betas), weight_decay=opt.weight_decay)
    norm = float(torch.nn.utils.clip_grad_norm_(params, MAX_NORM))
    optimizer.step()
    assert norm > MAX_NORM and ranks["metrics"]["grad_norm"] == pytest.approx(norm, rel=1e-5)
    for param, name in zip(params, fused, strict=True):
        torch.testing.assert_close(after[name], param.detach(), rtol=1e-5, atol=LR * 1e-4, msg=name)


def test_saved_adapter_is_peft_s_and_the_sync_sends_peft_s_merge(model_dir, ranks):
    saved = ranks["saved_adapter"]
    model = _peft(model_dir, adapter=saved).eval()
    batch = _batch(model.config.vocab_size)
    with torch.no_grad():
        torch.testing.assert_close(ranks["logits_after"], _forward(model, batch), atol=1e-5, rtol=0)
    tensors = {_hf_key(n): t for n, t in load_file(str(saved / "adapter_model.safetensors")).items()}
    assert tensors.keys() == ranks["adapter_after"].keys()
    merged = model.merge_and_unload().state_dict()
    assert set(ranks["merged"]) == set(merged)
    for name, tensor in merged.items():
        torch.testing.assert_close(ranks["merged"][name], tensor, atol=1e-6, rtol=1e-6, msg=name)
    scaling = ALPHA / RANK
    assert set(ranks["sync_adapter"]) == set(tensors)
    for name, tensor in tensors.items():
        want = tensor * scaling if ".lora_B." in name else tensor
        torch.testing.assert_close(ranks["sync_adapter"][name], want, atol=0, rtol=1e-6, msg=name)


def test_bf16_base_with_float32_adapters_is_as_close_as_transformers_own_bf16(model_dir, adapter_dir, ranks):
    dtypes = ranks["bf16_dtypes"]
    assert {d for n, d in dtypes.items() if ".lora." in n} == {torch.float32}
    assert {d for n, d in dtypes.items() if ".lora." not in n} == {torch.bfloat16}
    fp32 = _peft(model_dir, adapter=adapter_dir).eval()
    bf16 = _peft(model_dir, torch.bfloat16, adapter=adapter_dir).eval()
    batch = _batch(fp32.config.vocab_size)
    real = batch.attention_mask.bool()
    with torch.no_grad():
        want, reference = _forward(fp32, batch)[real], _forward(bf16, batch).float()[real]
    yardstick = float((reference - want).norm() / want.norm())
    got = float((ranks["bf16_logits"][real] - want).norm() / want.norm())
    assert yardstick / 4 < got < 2 * yardstick, (got, yardstick)


def test_targets_are_megatron_layer_names(model_dir):
    from inflight.megatron.lora_layers import target_layers

    assert target_layers(_cfg(model_dir)) == ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]
    assert (
        target_layers(_cfg(model_dir, "trainer.policy.model.lora.exclude_modules=[linear_fc2]"))[-1]
        == "linear_fc1"
    )
    with pytest.raises(ConfigError, match="linear_qkv"):
        target_layers(_cfg(model_dir, "trainer.policy.model.lora.target_modules=[q_proj,v_proj]"))


@pytest.fixture
def own_process_group():
    """A one-process run builds its own gloo group and megatron's parallel state: both go afterwards,
    so later tests in this process see none (make_worker picks FSDP when a group exists)."""
    created = not dist.is_initialized()
    yield
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if created and dist.is_initialized():
        dist.destroy_process_group()


def test_a_megatron_lora_run_checkpoints_and_resumes_the_adapter(
    tmp_path, tmp_path_factory, own_process_group
):
    """`inflight train`'s trainer with strategy=megatron and LoRA: the checkpoint's adapter is peft's
    and its model/ is peft's merge; a resumed run starts from that adapter and the engines from the
    merged weights (SkyRL's merge_lora) before anything is generated."""
    import asyncio

    from rl_support import rl_config, run_training, small_task, warm_model_dir

    from inflight.engine import SamplingParams
    from inflight.train.trainer import make_trainer

    model_dir = warm_model_dir(tmp_path_factory)  # rewards that differ within groups: gradients to follow
    ckpt = tmp_path / "ckpt"
    common = [
        "trainer.strategy=megatron", "trainer.policy.megatron_config.transformer_config_kwargs={}",
        "trainer.eval_interval=0", f"trainer.policy.model.lora.rank={RANK}",
        f"trainer.policy.model.lora.alpha={ALPHA}", f"trainer.ckpt_path={ckpt}", "trainer.ckpt_interval=1",
        "trainer.resume_mode=latest", "trainer.policy.optimizer_config.lr=1e-2",
    ]
    task = small_task()
    assert len(run_training(*rl_config(model_dir, tmp_path / "run", ["job.max_steps=1", *common]), task)) == 1
    saved = ckpt / "global_step_1"
    reference = _peft(model_dir, adapter=saved / "adapter").eval()
    adapter = {_hf_key(n): p.detach().clone() for n, p in reference.named_parameters() if ".lora_" in n}
    assert any(float(v.abs().max()) > 0 for n, v in adapter.items() if ".lora_B." in n)  # step 1 trained B
    merged = reference.merge_and_unload().eval()
    exported, state = load_file(str(saved / "model" / "model.safetensors")), merged.state_dict()
    assert set(exported) == set(state) - ({"lm_head.weight"} if merged.config.tie_word_embeddings else set())
    for name, tensor in exported.items():
        torch.testing.assert_close(tensor, state[name], atol=1e-6, rtol=1e-6, msg=name)
    prompt = task.encode(task.eval_problems()[0].prompt)

    async def resumed():
        trainer = make_trainer(*rl_config(model_dir, tmp_path / "run", ["job.max_steps=2", *common]), task)
        try:
            await trainer.setup()
            loaded = {n: t.clone() for n, t in trainer.policy.worker.hf_adapter_tensors()}
            out = await trainer.runtime.engines.local[0].generate(
                prompt, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
            return loaded, out.output_token_ids, await trainer.train()
        finally:
            await trainer.close()

    loaded, engine_tokens, history = asyncio.run(resumed())
    assert loaded.keys() == adapter.keys()
    for name, value in adapter.items():
        torch.testing.assert_close(loaded[name], value, atol=0, rtol=0, msg=name)
    ids, greedy = torch.tensor([prompt]), []
    with torch.no_grad():
        for _ in range(6):
            greedy.append(int(merged(ids).logits[0, -1].argmax()))
            ids = torch.cat([ids, torch.tensor([[greedy[-1]]])], dim=1)
    assert engine_tokens == greedy  # the engines hold peft's merge of the resumed adapter
    assert [r["step"] for r in history] == [2]
