"""Fault injection (issue 18): an engine process killed by PID (SIGKILL) at a seeded random point of
a weight sync — before its begin, before one of its chunks, before its finish — for each
cross-process transport (`shm`, `broadcast`; `inprocess` has no engine process). With
`trainer.fully_async.engine_restarts` the run recovers: the engine is restarted, every step is
trained, no prompt is trained twice and the restarted engine holds the policy's weights. Without,
the run stops within 30 s with an error naming the engine, its pid and the signal. Either way no
engine process outlives the trainer and nothing hangs (every wait here is bounded)."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal

import pytest
import torch
from rl_support import rl_config, small_task, warm_model_dir
from transformers import AutoModelForCausalLM

from inflight.client.process import EngineProcess, EngineProcessError
from inflight.engine import EngineConfig, SamplingParams
from inflight.orchestration.engine_restarts import EngineDiedError, EngineRestarts
from inflight.testing import LOCAL_CPU
from inflight.testing.oracle import hf_greedy
from inflight.train.trainer import make_trainer

SEED = int(os.environ.get("INFLIGHT_FAULT_SEED", "18"))
POINTS = ("begin", "chunk", "finish")
STOP_WITHIN_S = 30.0
STEPS = 2  # the kill comes in the sync of step 1 or 2
PROMPT = small_task().encode_prompt("3+4=")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return warm_model_dir(tmp_path_factory)


class KillDuringSync:
    """Wraps a runtime's transport: at sync `step`, kills engine `victim` right before `point`
    (`chunk`: before chunk `chunk`, or before the finish when the sync has fewer chunks)."""

    def __init__(self, runtime, rng: random.Random, victims: int) -> None:
        self.runtime, self.transport = runtime, runtime.transport
        self.point, self.step = rng.choice(POINTS), rng.choice((1, 2))
        self.chunk, self.victim = rng.randrange(0, 3), rng.randrange(victims)
        self.syncs, self.chunks, self.killed_pid, self.killed = 0, 0, None, asyncio.Event()
        begin, send_chunk, finish = self.transport.begin, self.transport.send_chunk, self.transport.finish

        async def killing_begin(client):
            self.syncs, self.chunks = self.syncs + 1, 0
            self._maybe_kill("begin")
            return await begin(client)

        async def killing_chunk(client, chunk):
            self._maybe_kill("chunk" if self.chunks == self.chunk else "")
            self.chunks += 1
            return await send_chunk(client, chunk)

        async def killing_finish(client, version):
            self._maybe_kill("finish" if self.point == "finish" else "chunk")
            return await finish(client, version)

        self.transport.begin, self.transport.send_chunk, self.transport.finish = (
            killing_begin, killing_chunk, killing_finish)

    def __repr__(self) -> str:
        return f"kill engine-{self.victim} before {self.point} (chunk {self.chunk}) of sync {self.step}"

    def _maybe_kill(self, here: str) -> None:
        if self.killed_pid is None and here == self.point and self.syncs == self.step:
            process = self.runtime.engine_procs[self.victim].process
            self.killed_pid = process.pid
            os.kill(process.pid, signal.SIGKILL)
            self.killed.set()


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    with open(f"/proc/{pid}/stat") as f:  # a zombie is gone too (not reaped yet by a test runner)
        return f.read().split(")")[-1].split()[0] == "Z"


def _run(model_dir, out, backend: str, restarts: int, engines: int):
    cfg, job = rl_config(
        model_dir,
        out,
        [
            f"generator.inference_engine.weight_sync_backend={backend}",
            f"generator.inference_engine.num_engines={engines}",
            "generator.inference_engine.weight_sync_chunk_size_mb=0.05",
            f"trainer.fully_async.engine_restarts={restarts}", f"job.max_steps={STEPS}",
        ],
    )
    rng = random.Random(f"{SEED}-{backend}-{restarts}")

    async def main():
        trainer = make_trainer(cfg, job, small_task())
        fault, error, pids = None, None, []
        try:
            await asyncio.wait_for(trainer.setup(), 120)
            fault = KillDuringSync(trainer.runtime, rng, engines)
            pids = [p.process.pid for p in trainer.runtime.engine_procs]
            train = asyncio.create_task(trainer.train())

            async def watchdog():  # bounded: the run must end (recover or fail) this long after the kill
                await fault.killed.wait()
                await asyncio.sleep(STOP_WITHIN_S * (3 if restarts else 1))
                train.cancel()

            guard = asyncio.create_task(watchdog())
            try:
                await train
            except EngineDiedError as err:
                error = err
            finally:
                guard.cancel()
            versions = await trainer.client.weight_versions() if error is None and engines > 1 else None
            if error is None and engines == 1:
                versions = {"engine-0": await trainer.client.weight_version()}
            procs = list(trainer.runtime.engine_procs)
            if error is None:  # the restarted engine's greedy tokens, and transformers' on the policy
                restarted = procs[fault.victim].client
                served = await restarted.generate(PROMPT, SamplingParams(max_tokens=6, temperature=0.0,
                                                                         ignore_eos=True))
                versions["greedy"] = (served.output_token_ids, served.logprobs)
                versions["oracle"] = hf_greedy(trainer.policy.worker.model, PROMPT, 6)
        finally:
            await asyncio.wait_for(trainer.close(), 60)
        return trainer, fault, error, versions, pids, procs

    return asyncio.run(main())


def _consumed(out) -> list[str]:
    rows = [json.loads(line) for line in (out / "consumed.jsonl").read_text().splitlines()]
    return [p for r in rows for p in r.get("trained", [])]


@pytest.mark.parametrize(("backend", "engines"), [("shm", 1), ("broadcast", 2)])  # 2: a live member regroups
def test_a_killed_engine_is_restarted_and_the_run_recovers(model_dir, tmp_path, backend, engines):
    trainer, fault, error, versions, pids, procs = _run(
        model_dir, tmp_path, backend, restarts=1, engines=engines
    )
    assert error is None and fault.killed_pid is not None, fault
    assert trainer.global_step == STEPS and trainer.restarts.restarts == 1, fault
    trained = _consumed(tmp_path)
    assert len(trained) == STEPS * 4 and len(set(trained)) == len(trained)  # every step, no prompt twice
    # every engine, the restarted one included, holds the policy's weights (one extra version:
    # the restart's full sync)
    # every engine, the restarted one included, holds the policy's weights (a restart made for a
    # failed generation adds a version: its own full sync)
    greedy, oracle = versions.pop("greedy"), versions.pop("oracle")
    assert (
        set(versions.values()) == {trainer.policy.weight_version} and trainer.policy.weight_version >= STEPS
    )
    # the restarted engine holds the policy's trained weights: transformers' tokens and logprobs on
    # them, which the start weights do not give (the oracle can tell)
    assert greedy[0] == oracle[0] and greedy[1] == pytest.approx(oracle[1], abs=1e-5)
    base = hf_greedy(AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32), PROMPT, 6)
    assert base[1] != pytest.approx(oracle[1], abs=1e-5)
    last = trainer.history[-1]
    assert last["engine/restarts"] == 1.0
    assert fault.killed_pid in pids and procs[fault.victim].process.pid != fault.killed_pid
    assert all(_gone(pid) for pid in pids) and all(p.process.poll() is not None for p in procs)


@pytest.mark.parametrize("backend", ["shm", "broadcast"])
def test_a_killed_engine_stops_the_run_naming_it_when_restarts_are_off(model_dir, tmp_path, backend):
    trainer, fault, error, _, pids, procs = _run(model_dir, tmp_path, backend, restarts=0, engines=1)
    assert fault.killed_pid is not None and error is not None, fault
    message = str(error)
    assert f"engine-0 (pid {fault.killed_pid}, killed by signal 9 (SIGKILL))" in message, message
    assert "trainer.fully_async.engine_restarts" in message
    assert trainer.global_step < STEPS
    assert all(_gone(pid) for pid in pids) and all(p.process.poll() is not None for p in procs)


def test_used_up_restarts_stop_the_run_naming_the_engine(model_dir):
    """The budget: with the run's one restart used, a second death is not restarted; the error
    names the engine, its pid and signal, and the budget's key."""
    proc = EngineProcess(EngineConfig(model=str(model_dir), num_kv_blocks=64), 1, name="engine-1")
    restarts = EngineRestarts([proc], None, budget=1)
    restarts.restarts = 1  # the run's one restart happened earlier
    pid = proc.process.pid

    async def main():
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(EngineProcessError) as died:
            await asyncio.wait_for(proc.client.weight_version(), 30)
        with pytest.raises(EngineDiedError) as stopped:
            await asyncio.wait_for(restarts.recover(died.value, None, since=1), 30)
        return str(stopped.value)

    try:
        message = asyncio.run(main())
    finally:
        proc.close()
    assert f"engine-1 (pid {pid}, killed by signal 9 (SIGKILL)) died (1 of 1 restarts used" in message
    assert "trainer.fully_async.engine_restarts" in message and proc.process.pid == pid  # not restarted


def test_inflight_train_says_which_engine_died_in_one_line(monkeypatch, capsys, tiny_model_factory, tmp_path):
    """`inflight train` ends a run whose engine died with rc 1 and the error's own words, not a
    traceback (the error names the engine, its pid and signal, and the key that restarts it)."""
    from inflight.train import main as train_main

    message = (
        "engine process engine-0 (pid 4242, killed by signal 9 (SIGKILL)) died (restarts are off: set ...)"
    )

    async def dies(*args, **kwargs):
        raise EngineDiedError(message)

    monkeypatch.setattr(train_main, "run_job", dies)
    model = tiny_model_factory("qwen2")
    rc = train_main.main([*LOCAL_CPU, "job.task=addition", f"trainer.policy.model.path={model}",
                          f"job.output_dir={tmp_path}"])
    err = capsys.readouterr().err
    assert rc == 1 and f"error: {message}" in err and "Traceback" not in err
