"""Checkpoint and resume: a fully-async run interrupted mid-step and resumed consumes every prompt
exactly once, and resumes the model, optimizer, step and weight version of its last checkpoint."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
from rl_support import rl_config, small_task, warm_model_dir
from safetensors.torch import load_file

from inflight.testing import LOCAL_CPU
from inflight.train.checkpoint import load_latest
from inflight.train.trainer import make_trainer
from inflight.weight_sync.shm import SHM_DIR, SHM_PREFIX


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return warm_model_dir(tmp_path_factory)


def _consumed(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.mark.parametrize("interrupt_after", [2, 3])
def test_interrupted_mid_step_and_resumed_uses_every_prompt_once(model_dir, tmp_path, interrupt_after):
    task = small_task(num_train=32)  # 4 prompts a step: 8 steps (SkyRL's run length: whole batches)
    overrides = [f"trainer.ckpt_path={tmp_path / 'ckpt'}", "trainer.ckpt_interval=1", "job.max_steps=null",
                 "trainer.resume_mode=latest"]
    cfg, job = rl_config(model_dir, tmp_path / "out", overrides)

    async def interrupted() -> None:
        trainer = make_trainer(cfg, job, task)
        await trainer.setup()
        original = trainer.policy.step_fn
        release = threading.Event()

        def step_then_stall(groups, version):
            metrics = original(groups, version)
            if trainer.global_step + 1 > interrupt_after:  # stall in the middle of the next step
                release.wait(30)
            return metrics

        trainer.policy.step_fn = step_then_stall
        run = asyncio.create_task(trainer.train())
        while trainer.global_step < interrupt_after:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)  # the trainer is now inside step interrupt_after + 1
        run.cancel()  # the "kill": nothing after this point is saved
        await asyncio.gather(run, return_exceptions=True)
        release.set()
        await trainer.close()

    asyncio.run(interrupted())
    ckpt = load_latest(tmp_path / "ckpt")
    assert ckpt is not None and ckpt.step == interrupt_after and ckpt.weight_version == interrupt_after
    n_first = len(_consumed(tmp_path / "out" / "consumed.jsonl"))
    first_run = [r for r in _consumed(tmp_path / "out" / "consumed.jsonl") if r["step"] <= ckpt.step]
    saved = load_file(str(ckpt.model_dir / "model.safetensors"))

    async def resumed():
        trainer = make_trainer(cfg, job, task)
        await trainer.setup()
        try:
            assert trainer.resumed_from == ckpt.path and trainer.global_step == ckpt.step
            assert await trainer.client.weight_version() == ckpt.weight_version
            for name, param in trainer.policy.worker.model.named_parameters():
                torch.testing.assert_close(param.detach(), saved[name], rtol=0, atol=0)
            adam_steps = {
                int(s["step"]) for s in trainer.policy.worker.optimizer.state_dict()["state"].values()
            }
            assert adam_steps and max(adam_steps) <= ckpt.step
            await trainer.train()
            return trainer.global_step
        finally:
            await trainer.close()

    final_step = asyncio.run(resumed())
    second_run = _consumed(tmp_path / "out" / "consumed.jsonl")[n_first:]
    trained = [i for r in first_run + second_run for i in r.get("trained", [])]
    assert sorted(trained) == sorted(p.id for p in task.train_problems()), (
        "a prompt was skipped or trained twice"
    )
    assert final_step == 8


def test_killed_process_resumes(model_dir, tmp_path):
    """The real thing: `inflight train` killed with SIGKILL after its first checkpoint, rerun with
    the same command: it resumes and every prompt is trained exactly once overall."""
    data = tmp_path / "data.jsonl"
    task = small_task(num_train=200)
    data.write_text("".join(json.dumps({"id": p.id, "prompt": p.prompt, "answer": p.answer}) + "\n"
                            for p in task.train_problems()))
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    cmd = [sys.executable, "-m", "inflight.train.main", *LOCAL_CPU,
           f"trainer.policy.model.path={model_dir}", f"trainer.ckpt_path={ckpt}", "trainer.ckpt_interval=1",
           "trainer.resume_mode=latest", "generator.inference_engine.weight_sync_backend=shm",
           "trainer.train_batch_size=4", "trainer.policy_mini_batch_size=4",
           "trainer.micro_train_batch_size_per_gpu=64", "generator.n_samples_per_prompt=4",
           "trainer.fully_async.num_parallel_generation_workers=8",
           "job.task=jsonl", f"job.train_data={data}", f"job.eval_data={data}", "job.num_eval=4",
           f"job.output_dir={out}", "job.max_steps=null", "job.tensorboard=false", "job.plot=false",
           "job.progress=false", "job.max_train_seconds=null"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while load_latest(ckpt) is None or load_latest(ckpt).step < 2:
        assert proc.poll() is None, "the first run exited before its second checkpoint"
        assert time.monotonic() < deadline
        time.sleep(0.1)
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    leaked = list(SHM_DIR.glob(f"{SHM_PREFIX}{proc.pid}-*"))
    assert leaked  # a SIGKILLed trainer cannot unlink its shared-memory buffer ...
    assert load_latest(ckpt).step < 50, "the first run finished before it was killed"
    first = [r for r in _consumed(out / "consumed.jsonl") if r["step"] <= load_latest(ckpt).step]
    n_first = len(_consumed(out / "consumed.jsonl"))
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "resumed from" in done.stdout
    assert not any(p.exists() for p in leaked)  # ... the next run removes it
    second = _consumed(out / "consumed.jsonl")[n_first:]
    trained = [i for r in first + second for i in r.get("trained", [])]
    assert sorted(trained) == sorted(p.id for p in task.train_problems())


def test_exports_are_in_the_models_own_dtype_and_load_with_transformers(tmp_path, tiny_model_factory):
    """A bf16 model's export is bf16 (half its float32 master weights), loadable by transformers to
    the master weights rounded once; the checkpoint keeps the float32 master for an exact resume."""
    import json

    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from inflight.config import load_config
    from inflight.train import LocalPolicyWorker
    from inflight.train.checkpoint import export_model, model_dtype

    base = tiny_model_factory("qwen2", seed=11)
    bf16_dir = tmp_path / "bf16-base"
    AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16).save_pretrained(bf16_dir)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (base / name).is_file():
            (bf16_dir / name).write_bytes((base / name).read_bytes())
    assert model_dtype(bf16_dir) is torch.bfloat16 and model_dtype(base) is torch.float32
    worker = LocalPolicyWorker(load_config(None, list(LOCAL_CPU)), model_path=str(bf16_dir)).setup()
    assert all(p.dtype == torch.float32 for p in worker.model.parameters())  # the master weights
    out = export_model(worker, bf16_dir, tmp_path / "exports", step=3)
    assert out == tmp_path / "exports" / "global_step_3"
    saved = load_file(str(out / "model.safetensors"))
    assert {t.dtype for t in saved.values()} == {torch.bfloat16}
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    for name, param in worker.model.named_parameters():
        torch.testing.assert_close(
            dict(reloaded.named_parameters())[name], param.detach().to(torch.bfloat16).float()
        )
