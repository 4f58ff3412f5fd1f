"""What each FSDP rank runs (torch.multiprocessing spawn, gloo): training steps and syncs through
WorkerDispatch into an engine living in rank 0's process, with requests in flight. Results are
written for the test process, which holds the oracles (transformers, torch)."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import threading
from pathlib import Path

import torch
import torch.distributed as dist
from sync_scenarios import FailingTransport, row_config, start_in_flight

from inflight.client import LocalClient
from inflight.engine import AsyncEngine, EngineConfig, LLMEngine, SamplingParams
from inflight.train import TrainBatch, WorkerDispatch
from inflight.train.workers.fsdp import FSDPPolicyWorker
from inflight.weight_sync import BroadcastReceiver, BroadcastTransport, InProcessTransport

TRAIN = ("trainer.policy.optimizer_config.lr=0.02", "trainer.policy.optimizer_config.weight_decay=0.0")
LOGIT_PROMPT = [5, 17, 99, 3, 250, 42]
# scenario -> (plan row, prefix caching, transport)
SCENARIOS = {
    "seed": ("async-clear-offload", False, "inprocess"),
    "seed-prefix": ("async-clear-offload", True, "inprocess"),
    "seed-clear-off": ("async-offload", False, "inprocess"),
    "seed-broadcast": ("async-clear-offload", False, "broadcast"),
    "failure": ("async-clear", False, "failing"),
}


def train_batch(rank: int, step: int, vocab: int = 384) -> TrainBatch:
    """Rank `rank`'s share of step `step`: 2 random sequences of 16 tokens, all but the first scored."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    ids = torch.randint(3, vocab, (2, 16), generator=gen)
    mask = torch.ones(2, 16)
    mask[:, 0] = 0
    return TrainBatch(ids, mask)


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
    # the engine's receiver, here a thread of this process (rank 0 also holds FSDP's default group)
    threading.Thread(
        target=lambda: BroadcastReceiver("127.0.0.1", transport.port, timeout=120).serve(engine), daemon=True
    ).start()
    return transport


async def scenario(worker: FSDPPolicyWorker, model_dir: str, name: str, step: int) -> dict:
    row, prefix, kind = SCENARIOS.get(name, ("async-keep", True, "inprocess"))
    cfg = row_config(row, prefix, *TRAIN)
    metrics = worker.train_step(train_batch(worker.rank, step))
    state = worker.full_hf_state_dict()
    result: dict = {"metrics": metrics, "state": state if worker.rank == 0 else None}
    if worker.rank != 0:
        dispatch = WorkerDispatch([worker], None, None, cfg)
        try:
            result["report"] = dataclasses.asdict(await dispatch.save_weights_for_sampler())
        except Exception as err:
            result["error"] = f"{type(err).__name__}: {err}"
        return result
    engine = make_engine(model_dir, prefix)
    client = LocalClient(AsyncEngine(engine))
    tasks = {} if name == "logits" else await start_in_flight(client, engine)
    transport = make_transport(kind, engine)
    dispatch = WorkerDispatch([worker], client, transport, cfg)
    try:
        result["report"] = dataclasses.asdict(await dispatch.save_weights_for_sampler())
    except Exception as err:
        result["error"] = f"{type(err).__name__}: {err}"
    finally:
        transport.close()
    result["outputs"] = {rid: await task for rid, task in tasks.items()}
    result["plan"] = dispatch.plan
    result["dispatch_version"] = dispatch.weight_version
    result["engine_version"] = engine.weight_version
    if name == "logits":
        params = dict(engine.model.named_parameters())
        result["weights_equal"] = {n: torch.equal(params[n], t) for n, t in state.items()}
        logits = record_logits(engine)
        greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        result["tokens"] = (await client.generate(LOGIT_PROMPT, greedy)).output_token_ids
        result["logits"] = torch.cat(logits)
    result["stats"] = dataclasses.asdict(engine.stats)
    await client.engine.close()
    return result


async def session(rank: int, model_dir: str) -> dict:
    cfg = row_config("async-keep", True, *TRAIN)
    worker = FSDPPolicyWorker(cfg, model_path=model_dir).setup()
    assert (worker.rank, worker.world_size) == (rank, 2)
    names = ["logits", *SCENARIOS]
    return {name: await scenario(worker, model_dir, name, step) for step, name in enumerate(names, 1)}


def run_rank(rank: int, port: int, model_dir: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        results = asyncio.run(session(rank, model_dir))
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()
