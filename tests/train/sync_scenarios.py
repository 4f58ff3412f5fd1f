"""Requests in flight across a sync through WorkerDispatch, and the oracles for how they must end.

Shared by the plan-row, failure and FSDP tests. The freeze point of each request is read back from
its output: the tokens sampled by weight version 0 were sampled before the sync, and a request
frozen mid-decode had KV for everything but its last sampled token.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import torch
from conftest_weights import greedy_params, hf_continue, hf_greedy, prompt

from inflight.config import Config, load_config
from inflight.engine import LLMEngine, RequestOutput
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
        None, [f"{k}={str(v).lower()}" for k, v in zip(keys, values, strict=True)] + list(extra)
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
