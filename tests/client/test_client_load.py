"""Load: 200 concurrent requests across 2 servers through RemoteClient while a loop runs 10
pause → update → resume cycles, cycling the KV fates (keep, offload, recompute). Every request
completes exactly once with the right number of tokens; no error, no hang; bounded in time."""

from __future__ import annotations

import asyncio
import random
import time

from safetensors.torch import load_file

from inflight.client import RemoteClient, update_weights
from inflight.engine import SamplingParams

NUM_REQUESTS = 200
MAX_TOKENS = 32
CYCLES = 10
FATES = ("keep", "offload", "recompute")
TIME_LIMIT_S = 60.0


async def sync_cycle(rc: RemoteClient, fate: str, version: int, weights) -> None:
    """One in-flight weight update with the given KV fate (docs/design.md section 3)."""
    await rc.pause("keep")
    if fate == "recompute":  # drop the KV: frozen requests are re-prefilled with the new weights
        assert await rc.reset_prefix_cache(reset_running_requests=True) is True
    if fate == "offload":  # KV to host during the sync, restored bit-exactly
        await rc.sleep(offload_kv=True)
        await rc.wake_up(["weights"])
    assert await update_weights(rc, weights, version) == version
    if fate == "offload":
        await rc.wake_up(["kv_cache"])
    await rc.resume()


def test_200_requests_across_2_servers_during_10_weight_updates(serve, model_dir):
    servers = [serve(max_num_seqs=16), serve(max_num_seqs=16)]
    weights = list(load_file(str(model_dir / "model.safetensors")).items())
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 380) for _ in range(rng.randint(4, 40))] for _ in range(NUM_REQUESTS)]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, top_k=40, ignore_eos=True)
    before = [s.engine.stats.as_dict() for s in servers]
    in_flight_at_cycle: list[int] = []

    def generated() -> int:
        return sum(s.engine.stats.generated_tokens for s in servers)

    async def requests(rc: RemoteClient):
        tasks = [
            asyncio.create_task(rc.generate(p, params, request_id=f"load-{i}", session_id=f"s{i % 50}"))
            for i, p in enumerate(prompts)
        ]
        return await asyncio.gather(*tasks)

    async def cycles() -> None:
        # Between updates, wait for 1/20 of the work to be done (bounded in time), so the updates are
        # spread over the first half of the run whatever the machine's speed. This loop runs in its own
        # thread and event loop, as a trainer's would: its polling does not wait behind 200 responses.
        share = NUM_REQUESTS * MAX_TOKENS // (2 * CYCLES)
        async with RemoteClient([s.url for s in servers], control_token=servers[0].control_token) as rc:
            for c in range(CYCLES):
                mark, deadline = generated(), time.monotonic() + 5.0
                while generated() - mark < share and time.monotonic() < deadline:
                    await asyncio.sleep(0.002)
                in_flight_at_cycle.append(sum(len(s.engine.engine.requests) for s in servers))
                await sync_cycle(rc, FATES[c % len(FATES)], c + 1, weights)

    async def scenario():
        async with RemoteClient([s.url for s in servers]) as rc:
            loop_thread = asyncio.to_thread(asyncio.run, cycles())
            outputs, _ = await asyncio.gather(requests(rc), loop_thread)
        async with RemoteClient([s.url for s in servers]) as rc:
            return outputs, await rc.weight_versions()

    start = time.monotonic()
    outputs, versions = asyncio.run(asyncio.wait_for(scenario(), TIME_LIMIT_S))
    elapsed = time.monotonic() - start

    assert elapsed < TIME_LIMIT_S
    assert all(n > 0 for n in in_flight_at_cycle), in_flight_at_cycle  # every update hit live requests
    assert sorted(o.request_id for o in outputs) == sorted(f"load-{i}" for i in range(NUM_REQUESTS))
    for out in outputs:
        assert out.finish_reason == "length" and len(out.output_token_ids) == MAX_TOKENS
        assert len(out.logprobs) == len(out.token_weight_versions) == MAX_TOKENS
        assert out.token_weight_versions == sorted(out.token_weight_versions)
    assert any(len(set(o.token_weight_versions)) > 1 for o in outputs)  # requests spanned updates
    assert set(versions.values()) == {CYCLES}
    after = [s.engine.stats.as_dict() for s in servers]
    delta = {k: sum(a[k] - b[k] for a, b in zip(after, before, strict=True)) for k in after[0]}
    assert delta["finished_requests"] == NUM_REQUESTS and delta["aborted_requests"] == 0  # exactly once
    assert delta["weight_updates"] == 2 * CYCLES and delta["failed_weight_updates"] == 0
    assert delta["generated_tokens"] == NUM_REQUESTS * MAX_TOKENS  # resets re-prefill, never resample
    assert delta["resets"] > 0 and delta["kv_invalidated_resets"] == 0  # explicit resets; backstop unused
    for s in servers:
        assert not s.engine.engine.has_unfinished_requests()
