"""Shared pieces of the RL trainer tests: a small warmed-up addition model (built once per test
session, on disk under pytest's base temp dir) and configs sized to run in seconds on 2 cores."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from inflight.config import Config
from inflight.config.job import JobConfig, split_job_config
from inflight.tasks import AdditionTask, build_base_model, warm_up

SMALL_MODEL = dict(hidden_size=64, num_hidden_layers=2, intermediate_size=256)


def small_task(num_train: int = 400) -> AdditionTask:
    """One-digit addition: 100 distinct problems, 20 held out."""
    return AdditionTask(max_digits=1, num_eval=20, num_train=num_train)


def warm_model_dir(tmp_path_factory, target: float = 0.3) -> Path:
    """A small model warmed up to about `target` greedy accuracy on `small_task()` (cached per session)."""
    path = tmp_path_factory.getbasetemp() / "warm-addition-small"
    marker = path / "warmup.json"
    if not marker.is_file():
        threads = torch.get_num_threads()
        build_base_model(path, seed=0, **SMALL_MODEL)
        report = warm_up(
            path,
            small_task(),
            steps=400,
            batch_size=64,
            max_seconds=None,
            target_accuracy=target,
            eval_every=20,
            seed=0,
        )
        torch.set_num_threads(threads)
        marker.write_text(json.dumps({"accuracy": report.accuracy, "steps": report.steps}))
    return path


def rl_config(model_dir: Path, out: Path, overrides: list[str] = ()) -> tuple[Config, JobConfig]:
    """A tiny fully-async run: 4 prompts x 4 samples per step, in-process engine by default."""
    from inflight.config import config_from_dict

    data = {
        "trainer": {
            "train_batch_size": 4,
            "policy_mini_batch_size": 4,
            "micro_train_batch_size_per_gpu": 64,
            "seed": 1,
            "policy": {
                "model": {"path": str(model_dir)},
                "optimizer_config": {"lr": 1e-4, "adam_betas": [0.9, 0.99], "weight_decay": 0.0},
            },
            "fully_async": {"enabled": True, "max_staleness_steps": 1, "num_parallel_generation_workers": 8},
        },
        "generator": {
            "n_samples_per_prompt": 4,
            "sampling_params": {"temperature": 1.0, "max_generate_length": 8},
            "inference_engine": {
                "weight_sync_backend": "inprocess",
                "max_model_len": 32,
                "max_num_seqs": 64,
                "num_kv_blocks": 64,
            },
        },
        "job": {
            "num_eval": 20,
            "output_dir": str(out),
            "tensorboard": False,
            "plot": False,
            "progress": False,
            "max_steps": 4,
        },
    }
    job, rest, other = split_job_config(data, list(overrides))
    return config_from_dict(with_local_cpu(rest), other), job


def with_local_cpu(data: dict) -> dict:
    """A config mapping over the `LOCAL_CPU` baseline: `data`'s own values win (nested or dotted)."""
    from inflight.config.loader import flatten, parse_override
    from inflight.testing import LOCAL_CPU

    merged = {key: value for key, value in (parse_override(text, []) for text in LOCAL_CPU)}
    merged.update(flatten(data))
    return merged


def mask_runs(traj) -> list[tuple[int, list[int]]]:
    """A trajectory's response as (loss mask, token ids) runs: sampled stretches (1) and the
    environment's / template's stretches (0) in order."""
    out: list[tuple[int, list[int]]] = []
    for tid, m in zip(traj.response_ids, traj.loss_mask, strict=True):
        if out and out[-1][0] == m:
            out[-1][1].append(tid)
        else:
            out.append((m, [tid]))
    return out


def play_train_problems(model_dir: Path, task, **generator_kwargs) -> list:
    """Two seeded samples of each of `task`'s training problems through a TaskGenerator on an
    in-process engine over `model_dir` (`generator_kwargs` go to the generator)."""
    import asyncio

    from inflight.client import LocalClient
    from inflight.engine import AsyncEngine, EngineConfig, LLMEngine
    from inflight.rollout.task_generator import TaskGenerator

    async def main():
        engine = AsyncEngine(LLMEngine(EngineConfig(model=str(model_dir), num_kv_blocks=64)))
        try:
            gen = TaskGenerator(LocalClient(engine), task, n=2, seed=1, **generator_kwargs)
            return await asyncio.gather(*(gen(p) for p in task.train_problems()))
        finally:
            await engine.close()

    return asyncio.run(main())


def run_training(cfg: Config, job: JobConfig, task) -> list[dict]:
    """Set up the trainer `cfg` asks for on `task`, train to the end, close; returns the history."""
    import asyncio

    from inflight.train.trainer import make_trainer

    async def main():
        trainer = make_trainer(cfg, job, task)
        try:
            await trainer.setup()
            return await trainer.train()
        finally:
            await trainer.close()

    return asyncio.run(main())
