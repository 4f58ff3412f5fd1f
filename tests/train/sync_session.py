"""What each policy rank runs (torch.multiprocessing spawn, 2 gloo ranks), for either backend:
FSDP2 (data parallel over both ranks) or Megatron (tensor parallel size 2, from the config key).
Training steps and syncs go through LocalPolicy into an engine living in rank 0's process, with
requests in flight. Results are written for the test process, which holds the oracles
(transformers, torch)."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import threading
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist
from sync_scenarios import (
    FailingTransport,
    colocated_sync,
    row_config,
    stale_cached_blocks,
    start_in_flight,
)

from inflight.client import LocalClient
from inflight.engine import AsyncEngine, EngineConfig, LLMEngine, SamplingParams
from inflight.train import LocalPolicy, TrainBatch
from inflight.train.workers.base import PolicyWorker
from inflight.weight_sync import BroadcastReceiver, BroadcastTransport, InProcessTransport

TRAIN = ("trainer.policy.optimizer_config.lr=0.02", "trainer.policy.optimizer_config.weight_decay=0.0")
BACKEND_KEYS = {
    "fsdp": ("trainer.strategy=fsdp",),
    "megatron": (
        "trainer.strategy=megatron",
        "trainer.placement.policy_num_gpus_per_node=2",
        "trainer.policy.megatron_config.tensor_model_parallel_size=2",
    ),
}
LOGIT_PROMPT = [5, 17, 99, 3, 250, 42]


class Scenario(NamedTuple):
    row: str  # a row of the plan table (sync_scenarios.ROWS)
    prefix: bool  # prefix caching
    transport: str  # inprocess | broadcast | failing
    train: bool  # a training step first (else: sync the weights of the last step)


SCENARIOS = {
    "logits": Scenario("async-keep", True, "inprocess", True),  # nothing in flight: logits compared
    "seed": Scenario("async-clear-offload", False, "inprocess", True),
    "seed-prefix": Scenario("async-clear-offload", True, "inprocess", True),
    "seed-clear-off": Scenario("async-offload", False, "inprocess", True),
    "seed-broadcast": Scenario("async-clear-offload", False, "broadcast", True),
    "failure": Scenario("async-clear", False, "failing", True),
    # the other rows of the plan table, with prefix caching on (the seeds cover it off)
    **{f"row-{row}": Scenario(row, True, "inprocess", False) for row in (
        "sync", "sync-offload", "async-keep", "async-offload", "async-clear", "colocated",
    )},
}  # fmt: skip
ROW_SCENARIO = {"async-clear-offload": "seed-prefix"} | {
    name[4:]: name for name in SCENARIOS if name.startswith("row-")
}
"""Plan-table row -> the scenario that ran it (prefix caching on)."""


def train_batch(data_rank: int, step: int, vocab: int = 384) -> TrainBatch:
    """Data-parallel rank `data_rank`'s share of step `step`: 2 random sequences of 16 tokens, all
    but the first scored (every rank of a tensor-parallel group gets the same share)."""
    gen = torch.Generator().manual_seed(1000 * step + data_rank)
    ids = torch.randint(3, vocab, (2, 16), generator=gen)
    mask = torch.ones(2, 16)
    mask[:, 0] = 0
    return TrainBatch(ids, mask)


def data_parallel_size(backend: str, world_size: int = 2) -> int:
    return world_size // 2 if backend == "megatron" else world_size


def make_worker(backend: str, model_dir: str) -> PolicyWorker:
    """This rank's worker, set up; the backend's settings come from the config."""
    cfg = row_config("async-keep", True, *TRAIN, *BACKEND_KEYS[backend])
    if backend == "fsdp":
        from inflight.train.workers.fsdp import FSDPPolicyWorker

        return FSDPPolicyWorker(cfg, model_path=model_dir).setup()
    from inflight.megatron.worker import MegatronPolicyWorker

    return MegatronPolicyWorker(cfg, model_path=model_dir).setup()


def make_engine(model_dir: str, prefix: bool) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=model_dir, block_size=4, num_kv_blocks=64, max_num_seqs=16, max_model_len=128,
            max_num_batched_tokens=8, enable_prefix_caching=prefix, seed=0,
        )
    )  # fmt: skip


def record_logits(engine: LLMEngine) -> list[torch.Tensor]:
    """Instrument the engine's LM head: every logits tensor it computes is kept."""
    recorded, compute = [], engine.model.compute_logits

    def recording(hidden):
        logits = compute(hidden)
        recorded.append(logits.clone())
        return logits

    engine.model.compute_logits = recording
    return recorded


def make_transport(kind: str, engine: LLMEngine):
    if kind == "failing":
        return FailingTransport(2, max_chunk_bytes=8192)
    if kind == "inprocess":
        return InProcessTransport(max_chunk_bytes=8192)
    transport = BroadcastTransport("127.0.0.1", 0, max_chunk_bytes=8192, timeout=120)
    # the engine's receiver, here a thread of this process (rank 0 also holds the trainer's default group)
    threading.Thread(
        target=lambda: BroadcastReceiver("127.0.0.1", transport.port, timeout=120).serve(engine), daemon=True
    ).start()
    return transport


async def sync_into_engine(policy: LocalPolicy, engine: LLMEngine, name: str, result: dict) -> None:
    """Rank 0: the scenario's engine side around `policy.sync_weights()`."""
    client, sc = policy.client, SCENARIOS[name]
    if sc.row == "colocated":
        report, result["after"] = await colocated_sync(client, policy)
        result["report"] = dataclasses.asdict(report)
        return
    tasks = {} if name == "logits" else await start_in_flight(client, engine)
    try:
        result["report"] = dataclasses.asdict(await policy.sync_weights())
    except Exception as err:
        result["error"] = f"{type(err).__name__}: {err}"
    finally:
        policy.transport.close()
    result["stale"] = stale_cached_blocks(engine, 1)
    result["outputs"] = {rid: await task for rid, task in tasks.items()}


async def check_logits(client: LocalClient, engine: LLMEngine, state: dict, result: dict) -> None:
    """Record whether the engine holds `state` bit for bit, and its logits over a greedy decode."""
    params = dict(engine.model.named_parameters())
    result["weights_equal"] = {n: torch.equal(params[n], t) for n, t in state.items()}
    logits = record_logits(engine)
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    result["tokens"] = (await client.generate(LOGIT_PROMPT, greedy)).output_token_ids
    result["logits"] = torch.cat(logits)


async def follow_sync(worker: PolicyWorker, cfg) -> dict:
    """A rank other than 0: take part in the sync's gathers and learn its outcome."""
    try:
        report = await LocalPolicy(cfg, worker, None, None).sync_weights()
        return {"report": dataclasses.asdict(report)}
    except Exception as err:
        return {"error": f"{type(err).__name__}: {err}"}


async def scenario(worker: PolicyWorker, backend: str, model_dir: str, name: str, step: int) -> dict:
    sc = SCENARIOS[name]
    cfg = row_config(sc.row, sc.prefix, *TRAIN, *BACKEND_KEYS[backend])
    result: dict = {}
    if sc.train:
        data_rank = worker.rank // getattr(worker, "tp", 1)
        result["metrics"] = worker.train_step(train_batch(data_rank, step))
        state = worker.full_hf_state_dict()
        result["state"] = state if worker.rank == 0 else None
    if worker.rank != 0:
        return result | await follow_sync(worker, cfg)
    engine = make_engine(model_dir, sc.prefix)
    client = LocalClient(AsyncEngine(engine))
    policy = LocalPolicy(cfg, worker, client, make_transport(sc.transport, engine))
    await sync_into_engine(policy, engine, name, result)
    result.update(plan=policy.plan, dispatch_version=policy.weight_version)
    result["engine_version"] = engine.weight_version
    if name == "logits":
        await check_logits(client, engine, state, result)
    result["stats"] = dataclasses.asdict(engine.stats)
    await client.engine.close()
    return result


async def session(rank: int, backend: str, model_dir: str) -> dict:
    worker = make_worker(backend, model_dir)
    assert (worker.rank, worker.world_size) == (rank, 2)
    results, trained = {"tp": getattr(worker, "tp", 1)}, None
    for step, name in enumerate(SCENARIOS, 1):
        results[name] = await scenario(worker, backend, model_dir, name, step)
        trained = name if SCENARIOS[name].train else trained
        results[name]["weights_of"] = trained  # the scenario whose "state" this sync sent
    if hasattr(worker, "shutdown"):
        worker.shutdown()
    return results


def run_rank(rank: int, backend: str, port: int, model_dir: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        results = asyncio.run(session(rank, backend, model_dir))
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()
