"""Requests in flight across a sync through LocalPolicy, and the oracles for how they must end.

Shared by the plan-row, failure and policy-backend (FSDP, Megatron) tests. The freeze point of each
request is read back from its output: the tokens sampled by weight version 0 were sampled before
the sync, and a request frozen mid-decode had KV for everything but its last sampled token.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import torch
from conftest_weights import greedy_params, hf_continue, hf_greedy, prompt

from inflight.config import Config, load_config
from inflight.engine import LLMEngine, RequestOutput
from inflight.testing import LOCAL_CPU
from inflight.weight_sync import InProcessTransport, TransportError

MAX_TOKENS = 32
PROMPTS = {"r5": prompt(5, 1), "r17": prompt(17, 2), "r33": prompt(33, 3)}
WARM = prompt(21, 9)  # finished before the sync: its blocks stay cached under version 0

KEYS = (
    "trainer.placement.colocate_all",
    "trainer.fully_async.enabled",
    "trainer.fully_async.clear_kv_cache_on_weight_sync",
    "generator.inference_engine.offload_kv_for_weight_sync",
)
# row -> (colocate, fully_async, clear, offload), in the order of the design table
ROWS = {
    "sync": (False, False, False, False),
    "sync-offload": (False, False, False, True),
    "async-keep": (False, True, False, False),
    "async-offload": (False, True, False, True),
    "async-clear": (False, True, True, False),
    "async-clear-offload": (False, True, True, True),  # with prefix caching off: the SkyRL bug's cell
    "colocated": (True, False, False, False),
}


def row_config(row: str, prefix: bool, *extra: str) -> Config:
    values = [*ROWS[row], prefix]
    keys = [*KEYS, "generator.inference_engine.enable_prefix_caching"]
    return load_config(
        None, [*LOCAL_CPU, *(f"{k}={str(v).lower()}" for k, v in zip(keys, values, strict=True)), *extra]
    )


async def start_in_flight(client, engine: LLMEngine) -> dict[str, asyncio.Task]:
    """A finished warm request, then the PROMPTS generating; returns once each is mid-decode."""
    await client.generate(WARM, greedy_params(4), request_id="warm")
    tasks = {
        rid: asyncio.create_task(client.generate(tokens, greedy_params(MAX_TOKENS), request_id=rid))
        for rid, tokens in PROMPTS.items()
    }
    for _ in range(20_000):
        snaps = [engine.get_request_output(rid) for rid in PROMPTS]
        if all(s is not None and len(s.output_token_ids) >= 2 for s in snaps):
            return tasks
        assert not any(t.done() for t in tasks.values()), "a request finished before the sync"
        await asyncio.sleep(0.0005)
    raise AssertionError("requests did not reach decode")


def stale_cached_blocks(engine: LLMEngine, version: int) -> list[int]:
    """Free blocks still published in the prefix cache with KV from before `version`."""
    with engine._lock:
        return [
            b.block_id
            for b in engine.pool.blocks
            if b.hash is not None and b.ref_count == 0 and b.weight_version < version
        ]


@dataclass
class Frozen:
    """One request's state at the sync, read back from its output."""

    tokens: list[int]  # prompt + tokens sampled before the sync
    before: list[int]  # tokens sampled before the sync
    after: list[int]  # tokens sampled after it
    num_cached: int  # tokens that had KV at the sync


def frozen(out: RequestOutput, old_version: int, new_version: int) -> Frozen:
    k = out.token_weight_versions.count(old_version)
    assert out.finish_reason == "length" and len(out.output_token_ids) == MAX_TOKENS
    assert out.token_weight_versions == [old_version] * k + [new_version] * (MAX_TOKENS - k)
    assert 2 <= k < MAX_TOKENS
    tokens = list(out.prompt_token_ids) + out.output_token_ids[:k]
    return Frozen(tokens, out.output_token_ids[:k], out.output_token_ids[k:], len(tokens) - 1)


_ORACLE: dict[tuple, list[int]] = {}


def keep_oracle(hf_old: torch.nn.Module, hf_new: torch.nn.Module, f: Frozen) -> list[int]:
    """The new weights continuing over the KV the old weights computed."""
    key = ("keep", id(hf_old), id(hf_new), tuple(f.tokens), len(f.after))
    if key not in _ORACLE:
        _ORACLE[key] = hf_continue(hf_old, hf_new, f.tokens, f.num_cached, len(f.after))
    return _ORACLE[key]


def recompute_oracle(hf_new: torch.nn.Module, f: Frozen) -> list[int]:
    """The new weights re-reading the whole sequence."""
    key = ("recompute", id(hf_new), tuple(f.tokens), len(f.after))
    if key not in _ORACLE:
        _ORACLE[key] = hf_continue(hf_new, hf_new, f.tokens, 0, len(f.after))
    return _ORACLE[key]


def check_fate(
    outputs: dict[str, RequestOutput],
    fate: str,
    hf_old: torch.nn.Module,
    hf_new: torch.nn.Module,
    old_version: int = 0,
    new_version: int = 1,
) -> None:
    """Every frozen request ended as `fate` (keep | recompute) promises, and the oracle can tell
    the two fates apart for at least one of them."""
    assert set(outputs) == set(PROMPTS)
    differ = False
    for rid, out in outputs.items():
        f = frozen(out, old_version, new_version)
        assert f.before == hf_greedy(hf_old, PROMPTS[rid], len(f.before)), f"{rid}: not the old weights"
        kept, recomputed = keep_oracle(hf_old, hf_new, f), recompute_oracle(hf_new, f)
        differ |= kept != recomputed
        if fate == "keep":
            assert f.after == kept, f"{rid}: not the new weights over the old KV"
            assert out.num_recomputed_tokens == 0
        else:
            assert f.after == recomputed, f"{rid}: not the new weights re-reading the sequence"
            assert out.num_recomputed_tokens == f.num_cached
    assert differ, "the oracle cannot tell keep from recompute here"


def expected_fate(plan) -> str:
    """How frozen requests must end: the plan's fate, or for the synchronous rows (where nothing
    should be in flight) what the engine guarantees: kept KV without sleep, and with the KV
    discarded by sleep the backstop's reset (recompute)."""
    if plan.kv_fate == "none":
        return "recompute" if plan.sleep and not plan.offload_kv else "keep"
    return "recompute" if plan.kv_fate == "recompute" else "keep"


def check_row(plan, report: dict, stats: dict, stale: list[int], prefix: bool, weights: dict) -> str:
    """A sync with PROMPTS in flight did what its plan row says: the plan's steps, version 1, every
    weight byte sent, reset counts, and the old version's cached blocks survive only where nothing
    reset or discarded them. Returns the fate the frozen requests must show (`check_fate`)."""
    assert report["ok"] and report["steps"] == plan.steps()
    assert report["version"] == 1
    assert report["chunks"] > 1 and report["bytes"] == sum(t.nbytes for t in weights.values())
    fate, n = expected_fate(plan), len(PROMPTS)
    assert stats["resets"] == (n if plan.reset_running_requests else 0)
    backstop = fate == "recompute" and not plan.reset_running_requests
    assert stats["kv_invalidated_resets"] == (n if backstop else 0)
    discarded = plan.sleep and not plan.offload_kv
    assert bool(stale) == (prefix and not plan.reset_prefix_cache and not discarded)
    return fate


async def colocated_sync(client, policy) -> tuple:
    """The colocated cycle: generate, sleep (as the colocated trainer does after generation), sync
    through `policy`, generate again. Returns (report, the greedy output of WARM after the sync)."""
    await client.generate(WARM, greedy_params(4))
    await client.sleep(offload_kv=False)
    report = await policy.sync_weights()
    return report, await client.generate(WARM, greedy_params(8))


def check_colocated(report: dict, plan, prefix: bool, after: RequestOutput, hf_new: torch.nn.Module) -> None:
    """The engine woke, loaded the new weights, reset the cache (with prefix caching) and generates
    exactly as the new model, recomputing everything."""
    reset = ("reset",) if prefix else ()
    steps = ("pause", "wake_up_weights", "send_weights", "wake_up_kv_cache", *reset, "resume")
    assert report["steps"] == plan.steps() == steps
    assert report["prefix_cache_empty"] is (True if prefix else None)
    assert after.output_token_ids == hf_greedy(hf_new, WARM, 8)
    assert after.token_weight_versions == [1] * 8 and after.num_cached_tokens == 0


class FailingTransport(InProcessTransport):
    """The in-process transport, failing on its `fail_at`-th chunk (a lost connection)."""

    def __init__(self, fail_at: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self.fail_at = fail_at
        self.sent = 0

    async def send_chunk(self, client, chunk) -> None:
        if self.sent == self.fail_at:
            raise TransportError(f"connection lost after {self.sent} chunks")
        await super().send_chunk(client, chunk)
        self.sent += 1
