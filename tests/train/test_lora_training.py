"""A LoRA policy end to end (`trainer.policy.model.lora.*`, `peft`): only the adapters train, each
in-flight sync sends the adapter, and after training the engine holds what `peft` merges; the
checkpoint has the adapter in peft's format beside the merged HF model. Oracles: `peft`
(`merge_and_unload`, `PeftModel.from_pretrained`) and `transformers`."""

from __future__ import annotations

import asyncio
import copy

import pytest
import torch
from rl_support import rl_config, small_task, warm_model_dir
from transformers import AutoModelForCausalLM

from inflight.engine import SamplingParams

peft = pytest.importorskip("peft")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return warm_model_dir(tmp_path_factory)  # rewards that differ within groups: gradients to follow


def test_lora_trains_the_adapter_and_syncs_it_in_flight(model_dir, tmp_path):
    from inflight.train.trainer import make_trainer

    ckpt = tmp_path / "ckpt"
    cfg, job = rl_config(model_dir, tmp_path / "run", [
        "job.max_steps=2", "trainer.eval_interval=0", "trainer.policy.model.lora.rank=4",
        "trainer.policy.model.lora.alpha=8", f"trainer.ckpt_path={ckpt}", "trainer.ckpt_interval=2",
        "trainer.policy.optimizer_config.lr=1e-2", "trainer.hf_save_interval=1",
        f"trainer.export_path={tmp_path / 'exports'}"])
    task = small_task()
    prompt = task.encode(task.eval_problems()[0].prompt)

    async def main():
        trainer = make_trainer(cfg, job, task)
        try:
            await trainer.setup()
            history = await trainer.train()
            engine = trainer.runtime.local_engines[0]
            out = await engine.generate(prompt, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
            return history, trainer.policy, out.output_token_ids
        finally:
            await trainer.close()

    history, policy, engine_tokens = asyncio.run(main())
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
    loaded = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), step / "adapter").eval()
    probe = torch.tensor([prompt])
    with torch.no_grad():
        torch.testing.assert_close(exported(probe).logits, merged(probe).logits, atol=1e-5, rtol=0)
        torch.testing.assert_close(loaded(probe).logits, merged(probe).logits, atol=1e-5, rtol=0)
