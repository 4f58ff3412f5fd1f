"""The Ray engine client's weight updates over a broadcast group it hosts: two engine actors joined
through a FanOutClient (one group, ranks 1 and 2: each chunk's bytes in one broadcast), then one
actor through its own client. Oracle: an in-process engine given the same tensors by
`load_weights` generates the same tokens and log-probabilities."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

ray = pytest.importorskip("ray", reason="ray is not installed: pip install torch==2.13.0 -e '.[ray]'")

from inflight.client import LocalClient, update_weights  # noqa: E402
from inflight.client.fanout import FanOutClient  # noqa: E402
from inflight.cluster import EngineActor, RayEngineClient, init_ray  # noqa: E402
from inflight.cluster.actors import dead_actors  # noqa: E402
from inflight.engine import AsyncEngine, EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from inflight.engine.models.loader import iter_safetensors  # noqa: E402

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PROMPT = [5, 6, 7, 8]


@pytest.fixture(scope="module")
def ray_cluster():
    init_ray(object_store_mib=256, num_cpus=4)
    yield
    ray.shutdown()


async def _oracle(config: EngineConfig, weights) -> list:
    client = LocalClient(AsyncEngine(LLMEngine(config)))
    await update_weights(client, weights)
    output = await client.generate(PROMPT, GREEDY)
    await client.engine.close()
    return [output.output_token_ids, output.logprobs]


def test_ray_engine_clients_update_weights_over_a_broadcast_group(ray_cluster, tiny_model_factory):
    config = EngineConfig(model=str(tiny_model_factory("qwen2")), block_size=4, num_kv_blocks=64)
    first = list(iter_safetensors(tiny_model_factory("qwen2", seed=1)))
    second = list(iter_safetensors(tiny_model_factory("qwen2", seed=2)))
    actors = [EngineActor.remote(config) for _ in range(2)]

    async def main():
        clients = [RayEngineClient(a) for a in actors]
        both = FanOutClient(clients)
        info = await both.init_weight_transfer(max_chunk_bytes=64 * 1024, timeout_s=60)
        version = await both.update_weights_broadcast(first, version=2)
        outputs = [await c.generate(PROMPT, GREEDY) for c in clients]
        await both.close_weight_transfer()
        alone = await clients[0].init_weight_transfer(max_chunk_bytes=64 * 1024, timeout_s=60)
        await clients[0].update_weights_broadcast(second, version=3)
        last = await clients[0].generate(PROMPT, GREEDY)
        await clients[0].close_weight_transfer()
        seen = [[o.output_token_ids, o.logprobs] for o in outputs]
        return (
            info,
            alone,
            version,
            await both.weight_versions(),
            seen,
            [last.output_token_ids, last.logprobs],
        )

    try:
        info, alone, version, versions, outputs, last = asyncio.run(main())
    finally:
        for actor in actors:
            ray.kill(actor)
    assert info["world_size"] == 3 and info["ranks"] == {"engine-0": 1, "engine-1": 2}
    assert alone["world_size"] == 2 and version == 2 and versions == {"engine-0": 3, "engine-1": 2}
    expected, expected_last = asyncio.run(_oracle(config, first)), asyncio.run(_oracle(config, second))
    # tokens exactly; logprobs to float32 accuracy (other processes' BLAS may sum in other orders)
    pairs = [(outputs[0], expected), (outputs[1], expected), (last, expected_last)]
    for (tokens, logprobs), (want_tokens, want_logprobs) in pairs:
        assert tokens == want_tokens and logprobs == pytest.approx(want_logprobs, abs=1e-5)
    assert last != expected


def test_a_killed_engine_actor_fails_its_calls_in_seconds_and_is_reported_dead(
    ray_cluster, tiny_model_factory
):
    """The Ray path of no wait on the dead (issue 18): an engine actor killed by PID (SIGKILL)
    fails the call waiting on it (a generation queued behind a KEEP pause: it would never end on
    its own) and every later call with RayActorError, and `dead_actors` (what a weight transport's
    wait for an acknowledgement asks every second) names it and not the live one."""
    config = EngineConfig(model=str(tiny_model_factory("qwen2")), block_size=4, num_kv_blocks=64)
    actors = [EngineActor.remote(config) for _ in range(2)]

    async def main():
        doomed, live = RayEngineClient(actors[0]), RayEngineClient(actors[1])
        pid = await actors[0].pid.remote()
        await doomed.pause("keep")
        waiting = asyncio.create_task(doomed.generate(PROMPT, GREEDY))
        await asyncio.sleep(0.2)  # the call reached the actor (it waits there either way)
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(ray.exceptions.RayActorError):
            await asyncio.wait_for(waiting, 30)  # bounded: it must not wait on the dead
        with pytest.raises(ray.exceptions.RayActorError):
            await asyncio.wait_for(doomed.weight_version(), 30)
        return await asyncio.to_thread(dead_actors, actors), await live.weight_version()

    try:
        dead, live_version = asyncio.run(main())
    finally:
        for actor in actors:
            ray.kill(actor)
    assert dead == [0] and live_version == 0


def test_engine_restarts_are_refused_for_ray_engine_actors():
    """`trainer.fully_async.engine_restarts` is not implemented for Ray actors yet: refused, not ignored."""
    from inflight.cluster.runtime import RayRuntime
    from inflight.orchestration.engine_restarts import EngineRestarts

    with pytest.raises(ValueError, match=r"trainer.fully_async.engine_restarts=2: .* RayRuntime"):
        EngineRestarts.of(RayRuntime(None), 2)
    assert EngineRestarts.of(RayRuntime(None), 0).engines == []
