"""A LoRA policy end to end (`trainer.policy.model.lora.*`, `peft`): only the adapters train, each
in-flight sync sends the adapter, and after training the engine holds what `peft` merges; the
checkpoint has the adapter in peft's format beside the merged HF model. Oracles: `peft`
(`merge_and_unload`, `PeftModel.from_pretrained`) and `transformers`."""

from __future__ import annotations

import asyncio
import copy
import json
from typing import Any

import pytest
import torch
from rl_support import rl_config, small_task, warm_model_dir
from transformers import AutoModelForCausalLM

from inflight.engine import SamplingParams
from inflight.testing import LOCAL_CPU

peft = pytest.importorskip("peft")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return warm_model_dir(tmp_path_factory)  # rewards that differ within groups: gradients to follow


async def _train_then_greedy(cfg, job, task, prompt: list[int]) -> tuple[list[dict], Any, list[int]]:
    """Train the run, then the first in-process engine's 6 greedy tokens for `prompt` (a colocated
    engine sleeps after generation until the next sync: woken first)."""
    from inflight.train.trainer import make_trainer

    trainer = make_trainer(cfg, job, task)
    try:
        await trainer.setup()
        history = await trainer.train()
        engine = trainer.runtime.engines.local[0]
        if not engine.engine.weights.awake:
            await engine.wake_up()
        out = await engine.generate(prompt, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
        return history, trainer.policy, out.output_token_ids
    finally:
        await trainer.close()


def test_lora_trains_the_adapter_and_syncs_it_in_flight(model_dir, tmp_path):

    ckpt = tmp_path / "ckpt"
    cfg, job = rl_config(model_dir, tmp_path / "run", [
        "job.max_steps=2", "trainer.eval_interval=0", "trainer.policy.model.lora.rank=4",
        "trainer.policy.model.lora.alpha=8", f"trainer.ckpt_path={ckpt}", "trainer.ckpt_interval=2",
        "trainer.resume_mode=latest",
        "trainer.policy.optimizer_config.lr=1e-2", "trainer.hf_save_interval=1",
        f"trainer.export_path={tmp_path / 'exports'}"])
    task = small_task()
    prompt = task.encode(task.eval_problems()[0].prompt)

    history, policy, engine_tokens = asyncio.run(_train_then_greedy(cfg, job, task, prompt))
    assert len(history) == 2 and sum(r["optimizer_steps"] for r in history) > 0
    worker = policy.worker
    trained = {id(p) for group in worker.optimizer.param_groups for p in group["params"]}
    names = [n for n, p in worker.model.named_parameters() if id(p) in trained]
    assert names and all(".lora_" in n for n in names)  # the optimizer holds only the adapters
    full = sum(p.numel() * p.element_size() for n, p in worker.model.named_parameters() if ".lora_" not in n)
    assert 0 < policy.history[-1]["bytes"] < 0.2 * full  # a sync moves the adapter, not the model

    merged = copy.deepcopy(worker.model).merge_and_unload().eval()
    with torch.no_grad():
        ids = torch.tensor([prompt])
        expected = []
        for _ in range(6):
            expected.append(int(merged(ids).logits[0, -1].argmax()))
            ids = torch.cat([ids, torch.tensor([[expected[-1]]])], dim=1)
    assert engine_tokens == expected  # the engine merged the same adapter peft merges
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():  # and there was an adapter to merge: training moved the policy
        moved = (merged(torch.tensor([prompt])).logits - base(torch.tensor([prompt])).logits).abs().max()
    assert moved > 1e-3

    exports = sorted(p.name for p in (tmp_path / "exports").iterdir())
    assert exports == ["global_step_1", "global_step_2"]  # every step (trainer.hf_save_interval=1)
    assert (tmp_path / "exports" / "global_step_2" / "adapter" / "adapter_config.json").is_file()
    step = ckpt / "global_step_2"
    exported = AutoModelForCausalLM.from_pretrained(step / "model", dtype=torch.float32).eval()
    loaded = peft.PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(model_dir), step / "adapter"
    ).eval()
    probe = torch.tensor([prompt])
    with torch.no_grad():
        torch.testing.assert_close(exported(probe).logits, merged(probe).logits, atol=1e-5, rtol=0)
        torch.testing.assert_close(loaded(probe).logits, merged(probe).logits, atol=1e-5, rtol=0)


def _greedy(model: torch.nn.Module, prompt: list[int], n: int = 6) -> list[int]:
    ids, out = torch.tensor([prompt]), []
    with torch.no_grad():
        for _ in range(n):
            out.append(int(model(ids).logits[0, -1].argmax()))
            ids = torch.cat([ids, torch.tensor([[out[-1]]])], dim=1)
    return out


def test_a_resumed_lora_run_continues_the_checkpoints_adapter(model_dir, tmp_path):
    from rl_support import run_training

    from inflight.train.trainer import make_trainer

    ckpt = tmp_path / "ckpt"
    common = [
        "trainer.eval_interval=0", "trainer.policy.model.lora.rank=4", "trainer.policy.model.lora.alpha=8",
        f"trainer.ckpt_path={ckpt}", "trainer.ckpt_interval=1", "trainer.resume_mode=latest",
        "trainer.policy.optimizer_config.lr=1e-2", "trainer.policy.optimizer_config.scheduler=linear",
    ]
    task = small_task()
    first = run_training(*rl_config(model_dir, tmp_path / "run", ["job.max_steps=1", *common]), task)
    assert len(first) == 1
    saved = ckpt / "global_step_1"
    state = json.loads((saved / "state.json").read_text())
    reference = peft.PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(model_dir), saved / "adapter"
    )
    expected_adapter = {n: p.detach().clone() for n, p in reference.named_parameters() if ".lora_" in n}
    # step 1 trained
    assert any(float(v.abs().max()) > 0 for n, v in expected_adapter.items() if "lora_B" in n)
    merged = reference.merge_and_unload().eval()
    saved_optimizer = torch.load(saved / "optimizer_rank0.pt", weights_only=False)
    prompt = task.encode(task.eval_problems()[0].prompt)

    async def resumed():
        trainer = make_trainer(*rl_config(model_dir, tmp_path / "run", ["job.max_steps=2", *common]), task)
        try:
            await trainer.setup()
            worker = trainer.policy.worker
            adapter = {n: p.detach().clone() for n, p in worker.model.named_parameters() if ".lora_" in n}
            optimizer = copy.deepcopy(worker.optimizer.state_dict())  # training steps it in place
            schedule = worker.lr_scheduler.last_epoch
            engine = trainer.runtime.engines.local[0]
            version = engine.weight_version
            out = await engine.generate(
                prompt, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
            )
            history = await trainer.train()
            moved = {n: p.detach().clone() for n, p in worker.model.named_parameters() if ".lora_" in n}
            return adapter, optimizer, schedule, version, out.output_token_ids, history, moved
        finally:
            await trainer.close()

    adapter, optimizer, schedule, version, engine_tokens, history, moved = asyncio.run(resumed())
    assert adapter.keys() == expected_adapter.keys()
    for name, value in expected_adapter.items():  # the resumed adapter is the saved one
        torch.testing.assert_close(adapter[name], value, atol=0, rtol=0)
    for key, value in saved_optimizer["optimizer"]["state"].items():  # and so is AdamW's state of it
        torch.testing.assert_close(optimizer["state"][key]["exp_avg"], value["exp_avg"], atol=0, rtol=0)
    assert schedule == saved_optimizer["lr_scheduler"]["last_epoch"] == 1  # the schedule's position
    assert version == state["weight_version"] + 1  # the adapter went out before anything was generated
    assert engine_tokens == _greedy(merged, prompt)  # the engines merged the resumed adapter onto the base
    assert [r["step"] for r in history] == [2]  # training continued from step 1
    assert history[0]["lr"] == pytest.approx(1e-2 * 0.5)  # the schedule (linear over 2 steps) at position 1
    assert any(not torch.equal(moved[n], adapter[n]) for n in adapter)  # and moved the adapter on


def test_lora_under_bf16_holds_the_frozen_base_in_bfloat16(tiny_model_factory):
    from inflight.config import load_config
    from inflight.train import LocalPolicyWorker, TrainBatch
    from inflight.train.lora import merged_tensors

    cfg = load_config(
        None,
        [
            *LOCAL_CPU, "trainer.policy.model.lora.rank=4", "trainer.policy.model.lora.alpha=8",
            "trainer.policy.optimizer_config.lr=1e-2",
        ],
    )
    worker = LocalPolicyWorker(cfg, model_path=str(tiny_model_factory("qwen2", seed=2)), bf16=True).setup()
    params = dict(worker.model.named_parameters())
    assert all(p.dtype == (torch.float32 if ".lora_" in n else torch.bfloat16) for n, p in params.items())
    ids = torch.randint(0, worker.model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    before = {n: p.detach().clone() for n, p in params.items()}
    assert worker.train_step(TrainBatch(input_ids=ids, loss_mask=torch.ones_like(ids)))["grad_norm"] > 0
    moved = {n for n, p in params.items() if not torch.equal(p.detach(), before[n])}
    assert moved and all(".lora_" in n for n in moved)  # only the float32 adapters train
    expected = copy.deepcopy(worker.model).merge_and_unload().state_dict()
    merged = dict(merged_tensors(worker.model))
    assert merged.keys() == expected.keys()
    for name, tensor in merged.items():  # peft's merge, in the base's bfloat16
        assert tensor.dtype == torch.bfloat16
        torch.testing.assert_close(tensor, expected[name], atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("sleeping", [
    ["generator.inference_engine.offload_kv_for_weight_sync=true"],
    ["trainer.placement.colocate_all=true", "trainer.fully_async.enabled=false"],
], ids=["offload", "colocate"])
def test_lora_with_sleeping_engines_sends_the_merged_weights(model_dir, tmp_path, sleeping):

    cfg, job = rl_config(model_dir, tmp_path / "run", [
        "job.max_steps=2", "trainer.eval_interval=0", "trainer.policy.model.lora.rank=4",
        "trainer.policy.model.lora.alpha=8", "trainer.policy.optimizer_config.lr=1e-2", *sleeping])
    task = small_task()
    prompt = task.encode(task.eval_problems()[0].prompt)

    history, policy, engine_tokens = asyncio.run(_train_then_greedy(cfg, job, task, prompt))
    assert sum(r["optimizer_steps"] for r in history) > 0 and policy.history
    full = sum(
        p.numel() * p.element_size() for n, p in policy.worker.model.named_parameters() if ".lora_" not in n
    )
    assert all(sync["bytes"] >= full for sync in policy.history)  # every sync: the whole merged model
    merged = copy.deepcopy(policy.worker.model).merge_and_unload().eval()
    assert engine_tokens == _greedy(merged, prompt)  # the engine holds what peft merges
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():  # and there was an adapter in it: training moved the policy
        assert (
            merged(torch.tensor([prompt])).logits - base(torch.tensor([prompt])).logits
        ).abs().max() > 1e-3


def test_a_lora_checkpoints_state_copies_the_models_own_tensors_only(tiny_model_factory):
    from inflight.config import load_config
    from inflight.train import LocalPolicyWorker

    cfg = load_config(
        None,
        [*LOCAL_CPU, "trainer.policy.model.lora.rank=4", "trainer.policy.model.lora.target_modules=q_proj"],
    )
    worker = LocalPolicyWorker(cfg, model_path=str(tiny_model_factory("qwen2", seed=2))).setup()
    state = worker.full_hf_state_dict()
    own = {p.data_ptr() for p in worker.model.parameters()}
    assert not any(t.data_ptr() in own for t in state.values())  # nothing aliases the training model
    expected = copy.deepcopy(worker.model).merge_and_unload().state_dict()
    assert state.keys() <= expected.keys()
    for name, tensor in state.items():
        torch.testing.assert_close(tensor, expected[name], atol=0, rtol=0)
