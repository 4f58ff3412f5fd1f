"""The engine in its own process: ProcessClient generation, errors crossing the pipe with their
class, a shared-memory weight sync through the policy with requests in flight, shutdown, and
weight updates over a broadcast group the client hosts."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "train"))  # the train tests' helpers
from rl_support import small_task, warm_model_dir  # noqa: E402

from inflight.client import LocalClient, update_weights  # noqa: E402
from inflight.client.process import EngineProcess, EngineProcessError, ReceiverSpec  # noqa: E402
from inflight.config import load_config  # noqa: E402
from inflight.engine import (  # noqa: E402
    AsyncEngine,
    EngineConfig,
    InvalidRequestError,
    LLMEngine,
    SamplingParams,
    WeightUpdateError,
)
from inflight.engine.models.loader import iter_safetensors  # noqa: E402
from inflight.testing import LOCAL_CPU
from inflight.train import LocalPolicy, LocalPolicyWorker  # noqa: E402
from inflight.weight_sync import ShmTransport  # noqa: E402
from inflight.weight_sync.kinds import SHM  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return warm_model_dir(tmp_path_factory)


def test_process_client_generates_syncs_in_flight_and_closes(model_dir):
    task = small_task()
    transport = ShmTransport(max_chunk_bytes=16 << 20)
    proc = EngineProcess(EngineConfig(model=str(model_dir), num_kv_blocks=64), 1,
                         ReceiverSpec(SHM, "127.0.0.1", transport.port))
    cfg = load_config(
        None,
        [*LOCAL_CPU, f"trainer.policy.model.path={model_dir}", "trainer.policy.optimizer_config.lr=1e-2"],
    )

    async def main():
        client = proc.client
        prompt = task.encode_prompt("3+4=")
        greedy = await client.generate(prompt, SamplingParams(max_tokens=4, temperature=0.0))
        assert greedy.token_weight_versions and set(greedy.token_weight_versions) == {0}
        with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
            await client.generate([999], SamplingParams(max_tokens=2))
        worker = LocalPolicyWorker(cfg).setup()
        with torch.no_grad():
            for p in worker.model.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        policy = LocalPolicy(cfg, worker, client, transport)
        # long enough (~100 steps) that the sync lands mid-generation on any machine: 20 tokens ran
        # out before the pause arrived on some runs
        long = SamplingParams(max_tokens=100, temperature=1.0, ignore_eos=True, seed=1)
        in_flight = [asyncio.create_task(client.generate(prompt, long)) for _ in range(8)]
        await asyncio.sleep(0.01)
        report = await policy.sync_weights()
        outs = await asyncio.gather(*in_flight)
        assert report.ok and report.steps == ("pause", "send_weights", "resume")
        assert await client.weight_version() == 1
        assert all(len(o.output_token_ids) == 100 for o in outs)
        assert any(1 in o.token_weight_versions for o in outs)  # tokens after the sync: new weights
        assert any({0, 1} <= set(o.token_weight_versions) for o in outs)  # the sync landed mid-request
        stats = await client.stats()
        assert stats["weight_updates"] == 1 and stats["pauses"] == 1

    try:
        asyncio.run(main())
    finally:
        transport.close()
        proc.close()
    assert proc.process.poll() is not None


def test_process_client_updates_weights_over_a_broadcast_group(model_dir):
    """The client hosts rank 0, the engine process joins at rank 1; each chunk's metadata through
    the pipe, its bytes in one broadcast (64 KiB chunks: some tensors in pieces). Oracle: an
    in-process engine given the same tensors by `load_weights` generates the same tokens and
    log-probabilities. A refused update keeps the group in step; after closing there is none."""
    gen = torch.Generator().manual_seed(0)
    new = [(n, t + 0.05 * torch.randn(t.shape, generator=gen)) for n, t in iter_safetensors(model_dir)]
    wrong = [(n, torch.zeros(3)) if n == "model.norm.weight" else (n, t) for n, t in new]
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompt = small_task().encode_prompt("3+4=")
    proc = EngineProcess(EngineConfig(model=str(model_dir), num_kv_blocks=64), 1)

    async def main():
        client = proc.client
        info = await client.init_weight_transfer(max_chunk_bytes=64 * 1024, timeout_s=60)
        version = await client.update_weights_broadcast(new, version=2)
        with pytest.raises(WeightUpdateError):
            await client.update_weights_broadcast(wrong, version=3)
        still = await client.weight_version()
        again = await client.update_weights_broadcast(new)  # the group is still in step
        output = await client.generate(prompt, greedy)
        await client.close_weight_transfer()
        with pytest.raises(RuntimeError, match="init_weight_transfer"):
            await client.update_weights_broadcast(new)
        oracle = LocalClient(AsyncEngine(LLMEngine(EngineConfig(model=str(model_dir), num_kv_blocks=64))))
        await update_weights(oracle, new)
        expected = await oracle.generate(prompt, greedy)
        await oracle.engine.close()
        return info, version, still, again, output, expected

    try:
        info, version, still, again, output, expected = asyncio.run(main())
    finally:
        proc.close()
    assert info["world_size"] == 2 and info["ranks"] == {"engine": 1}
    assert (version, still, again) == (2, 2, 3)
    # tokens exactly; logprobs to float32 accuracy: the two processes' BLAS may block the sums
    # differently (AVX2 MKL does, per thread count), while a wrong weight moves them by > 1e-2
    assert output.output_token_ids == expected.output_token_ids
    assert output.logprobs == pytest.approx(expected.logprobs, abs=1e-5)


def test_a_killed_engine_process_fails_its_calls_naming_it_and_restarts_paused(model_dir):
    """Issue 18: a child killed by PID fails the call waiting on it (a generation queued behind a
    KEEP pause) and every later call with an EngineProcessError naming the engine, its pid and the
    signal; `restart()` starts a new child behind the same client, in a KEEP pause, so it runs
    nothing until it is resumed (after a weight sync, in training)."""
    prompt = small_task().encode_prompt("3+4=")
    greedy = SamplingParams(max_tokens=4, temperature=0.0)
    proc = EngineProcess(EngineConfig(model=str(model_dir), num_kv_blocks=64), 1, name="engine-3")

    async def main():
        client = proc.client
        expected = await client.generate(prompt, greedy)
        await client.pause("keep")
        waiting = asyncio.create_task(client.generate(prompt, greedy))
        await asyncio.sleep(0.2)
        pid = proc.process.pid
        os.kill(pid, signal.SIGKILL)
        died = rf"engine-3 \(pid {pid}\) exited: killed by signal 9 \(SIGKILL\)"
        with pytest.raises(EngineProcessError, match=died):
            await asyncio.wait_for(waiting, 30)  # bounded: it must not wait on the dead
        with pytest.raises(EngineProcessError, match=died):
            await asyncio.wait_for(client.weight_version(), 30)
        described = proc.describe()
        await asyncio.to_thread(proc.restart)
        status = await client.status()
        await client.resume()
        again = await asyncio.wait_for(client.generate(prompt, greedy), 30)
        return pid, described, status, expected, again

    try:
        pid, described, status, expected, again = asyncio.run(main())
    finally:
        proc.close()
    assert described == f"engine-3 (pid {pid}, killed by signal 9 (SIGKILL))"
    assert proc.process.pid != pid and proc.process.poll() is not None
    assert status["pause"] == "paused" and status["pause_mode"] == "keep" and status["weight_version"] == 0
    assert again.output_token_ids == expected.output_token_ids  # the same model, loaded again


class CountingConn:
    """A pipe end that records the messages sent and received through it (each a list of calls or answers)."""

    def __init__(self, conn) -> None:
        self.conn, self.sent, self.received = conn, [], []

    def send(self, message) -> None:
        self.sent.append(message)
        self.conn.send(message)

    def recv(self):
        message = self.conn.recv()
        self.received.append(message)
        return message

    def close(self) -> None:
        self.conn.close()


def test_the_calls_of_one_loop_turn_travel_as_one_message_each_way(model_dir):
    """A group's requests, issued together, cross the pipe as one message, and the answers of
    requests that finish in the same engine step come back as one: the per-message pickling and
    wake-ups were most of the rollout loop's own time. Each answer still reaches its own call."""
    task = small_task()
    with EngineProcess(EngineConfig(model=str(model_dir), num_kv_blocks=64), 1) as proc:
        client = proc.client
        conn = client._link.conn = CountingConn(client._link.conn)
        prompts = [task.encode_prompt(f"{a}+{a}=") for a in range(8)]
        params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)

        async def main():
            solo = [await client.generate(p, params) for p in prompts]
            conn.sent.clear(), conn.received.clear()
            together = await asyncio.gather(*(client.generate(p, params) for p in prompts))
            return solo, together, list(conn.sent), list(conn.received)

        solo, together, sent, received = asyncio.run(main())
    assert [o.output_token_ids for o in together] == [o.output_token_ids for o in solo]
    assert [len(m) for m in sent] == [8] and all(c[1] == "generate" for c in sent[0])
    assert [len(m) for m in received] == [8]  # same length, same step: answered together
