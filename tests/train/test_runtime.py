"""The runtime the trainers run on: `start_local` returns the engines' client and the policy and
stops what it started when a later part fails; `inflight.train` never imports Ray or
`inflight.cluster` (only the CLI passes `start_ray`)."""

from __future__ import annotations

import ast
import asyncio
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from inflight.client import LocalClient
from inflight.config import load_config
from inflight.config.job import JobConfig
from inflight.testing import LOCAL_CPU
from inflight.train.main import main
from inflight.train.policy import TRAIN_THREAD_NAME, LocalPolicy
from inflight.train.runtime import LocalRuntime, start_local


def _cfg(model_dir):
    return load_config(
        None,
        [
            *LOCAL_CPU, f"trainer.policy.model.path={model_dir}",
            "generator.inference_engine.num_kv_blocks=32",
            "generator.inference_engine.weight_sync_backend=inprocess",
        ],
    )


def test_train_imports_neither_ray_nor_cluster():
    code = (
        "import sys, inflight.train.main, inflight.train.trainer, inflight.train.runtime; "
        "print(sorted(m for m in sys.modules if m == 'ray' or m.startswith(('ray.', 'inflight.cluster'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_no_module_of_train_imports_ray_or_cluster_even_on_use():
    train = Path(__file__).resolve().parents[2] / "inflight" / "train"
    found = []
    for path in sorted(train.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            names += [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            found += [
                f"{path.name}: {n}" for n in names if n == "ray" or n.startswith(("ray.", "inflight.cluster"))
            ]
    assert found == []


def test_ray_runs_need_the_cli(capsys):
    assert main(["--ray"]) == 2
    assert "inflight train --ray" in capsys.readouterr().err


def test_start_local_gives_the_client_and_the_policy(tiny_model_factory):
    model_dir = tiny_model_factory()

    async def run():
        runtime = await start_local(_cfg(model_dir), JobConfig(worker="local"), pad_id=0, model_dir=model_dir,
                                    version=3)
        try:
            assert isinstance(runtime.client, LocalClient) and isinstance(runtime.policy, LocalPolicy)
            assert runtime.policy.weight_version == 3 and runtime.policy.kv_fate == "keep"
            assert await runtime.client.weight_version() == 3
            report = await runtime.policy.sync_weights()
            assert report.ok and report.version == 4 == runtime.policy.weight_version
            assert report.steps == runtime.policy.plan.steps() == ("pause", "send_weights", "resume")
        finally:
            await runtime.close()
            await runtime.close()  # idempotent
        return runtime

    runtime = asyncio.run(run())
    assert runtime.engines is None and runtime.transport is None


def test_start_local_stops_the_engines_when_the_policy_fails(tiny_model_factory, monkeypatch):
    model_dir = tiny_model_factory()
    closed: list[LocalRuntime] = []
    close = LocalRuntime.close

    async def recording_close(self):
        closed.append(self)
        await close(self)

    def failing_load(*args, **kwargs):
        raise RuntimeError("no policy today")

    monkeypatch.setattr(LocalRuntime, "close", recording_close)
    monkeypatch.setattr(LocalPolicy, "load", failing_load)
    with pytest.raises(RuntimeError, match="no policy today"):
        asyncio.run(start_local(_cfg(model_dir), JobConfig(worker="local"), pad_id=0, model_dir=model_dir))
    assert len(closed) == 1 and closed[0].engines is None and closed[0].transport is None


def test_every_training_step_runs_on_the_policys_one_named_thread(tiny_model_factory):
    """`LocalPolicy.train` keeps the event loop free and always uses the same thread, named
    `TRAIN_THREAD_NAME` (bench rl gives it a core of its own)."""
    model_dir = tiny_model_factory()

    async def run():
        runtime = await start_local(_cfg(model_dir), JobConfig(worker="local"), pad_id=0, model_dir=model_dir)
        try:
            seen = []

            def step(groups, version):
                seen.append((threading.current_thread().name, threading.get_native_id(), version))
                return {}

            runtime.policy.step_fn = step
            await runtime.policy.train([], 0)
            await runtime.policy.train([], 1)
            return seen, threading.get_native_id()
        finally:
            await runtime.close()

    seen, loop_thread = asyncio.run(run())
    (name, tid, _), (name2, tid2, version2) = seen
    assert (
        name.startswith(TRAIN_THREAD_NAME) and name2 == name and tid2 == tid != loop_thread and version2 == 1
    )
