"""Weight updates over a broadcast group through the InferenceClient calls: a RemoteClient hosting
rank 0 of a gloo group with two live servers (ranks 1 and 2), and a LocalClient making the same
calls in process. torch is the oracle: every engine parameter equals the sent tensor."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import torch

from inflight.client import FanOutError, LocalClient, RemoteClient, RemoteWeightUpdateError, wire
from inflight.engine import AsyncEngine, EngineConfig, SamplingParams, WeightUpdateError
from inflight.engine.models.loader import iter_safetensors

CHUNK = 64 * 1024  # below the largest tensor (96 KiB): some tensors travel in pieces
GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def weights_of(engine) -> dict[str, torch.Tensor]:
    """An LLMEngine's parameters by HF name."""
    params = dict(engine.model.named_parameters())
    return {n: params[engine.model.resolve(n)].detach().clone() for n in engine.model.hf_parameter_names()}


def equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


def with_wrong_shape(named: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    return [(n, torch.zeros(t.numel() + 1) if n == "model.norm.weight" else t) for n, t in named]


@pytest.fixture(scope="module")
def new_weights(tiny_model_factory) -> list[tuple[str, torch.Tensor]]:
    return list(iter_safetensors(tiny_model_factory("qwen2", seed=1)))


def test_remote_client_updates_two_servers_over_one_group(serve, new_weights):
    servers = [serve(), serve()]
    expected = dict(new_weights)

    async def run():
        async with RemoteClient([s.url for s in servers], control_token=servers[0].control_token) as client:
            info = await client.init_weight_transfer(max_chunk_bytes=CHUNK, timeout_s=60)
            version = await client.update_weights_broadcast(new_weights, version=4)
            updated = [weights_of(s.engine.engine) for s in servers]
            with pytest.raises(FanOutError) as refused:
                await client.update_weights_broadcast(with_wrong_shape(new_weights), version=5)
            after_refusal = await client.weight_versions(), [weights_of(s.engine.engine) for s in servers]
            output = await client.generate([5, 6, 7], GREEDY)
            again = await client.update_weights_broadcast(new_weights)  # the group is still in step
            await client.close_weight_transfer()
            health = await client.health()
        return info, version, updated, refused.value, after_refusal, output, again, health

    info, version, updated, refused, (versions, kept), output, again, health = asyncio.run(run())
    assert info["world_size"] == 3 and sorted(info["ranks"].values()) == [1, 2] and info["backend"] == "gloo"
    assert version == 4 and all(equal(w, expected) for w in updated)
    assert (
        all(isinstance(e, RemoteWeightUpdateError) for e in refused.errors.values())
        and len(refused.errors) == 2
    )
    assert "model.norm.weight" in str(refused)
    assert set(versions.values()) == {4} and all(
        equal(w, expected) for w in kept
    )  # aborted: old weights back
    assert len(output.output_token_ids) == 4 and again == 5
    assert all(h["weight_transfer"] is None for h in health.values())


def test_a_server_out_of_the_group_drops_it_and_a_new_init_recovers(serve, new_weights):
    servers = [serve(), serve()]
    token = servers[0].control_token

    async def run():
        async with RemoteClient([s.url for s in servers], control_token=token) as client:
            await client.init_weight_transfer(max_chunk_bytes=CHUNK, timeout_s=3)
            async with httpx.AsyncClient() as http:  # the second server leaves behind the client's back
                left = await http.post(servers[1].url + wire.DESTROY_WEIGHT_TRANSFER,
                                       headers={"Authorization": f"Bearer {token}"})  # fmt: skip
            with pytest.raises(FanOutError) as failed:
                await client.update_weights_broadcast(new_weights, version=7)
            versions = await client.weight_versions()
            with pytest.raises(RuntimeError, match="init_weight_transfer"):
                await client.update_weights_broadcast(new_weights)
            await client.init_weight_transfer(max_chunk_bytes=CHUNK, timeout_s=60)  # replaces stale groups
            version = await client.update_weights_broadcast(new_weights, version=7)
        return left.json(), failed.value, versions, version

    left, failed, versions, version = asyncio.run(run())
    assert left["destroyed"] is True
    codes = {url: e.code for url, e in failed.errors.items()}
    assert codes[servers[1].url] == "no_weight_transfer_group"
    assert codes.get(servers[0].url) in (None, "weight_transfer_failed")  # its broadcast may time out
    assert "dropped" in " ".join(failed.__notes__)
    assert set(versions.values()) == {0}  # the failed update was aborted on both servers
    assert version == 7 and all(equal(weights_of(s.engine.engine), dict(new_weights)) for s in servers)


def test_a_server_that_is_gone_fails_the_group_at_once_and_frees_the_live_one(serve):
    """No wait on the dead (issue 18): the host used to wait for every join, and the live server's
    join waited in the group's rendezvous for the gone server's rank until the group's timeout
    (120 s here). At the first failed join the host now drops the rendezvous: the live server's
    join fails at once and it keeps no group."""
    live, gone = serve(), serve()
    gone.stop()

    async def run():
        async with RemoteClient([live.url, gone.url], control_token=live.control_token) as client:
            with pytest.raises(FanOutError) as failed:  # bounded wait: far below the group's timeout
                await asyncio.wait_for(client.init_weight_transfer(max_chunk_bytes=CHUNK, timeout_s=120), 30)
        return failed.value

    failed = asyncio.run(run())
    assert set(failed.errors) == {live.url, gone.url}
    assert httpx.get(live.url + wire.HEALTH, timeout=30).json()["weight_transfer"] is None


HOST = """
import json, time
from inflight.weight_sync.group import GroupHost
host = GroupHost(2, "127.0.0.1", 0, timeout_s=120)
print(json.dumps(host.init_request(1)), flush=True)
time.sleep(600)  # never forms the group: killed by the test
"""


def test_a_server_joining_a_group_whose_host_dies_answers_at_once(serve):
    """A server waiting to join fails as soon as the host's process is gone, with a 502 that says
    the master was lost (it used to answer 504 "did not form within 120s": the group's timeout,
    which it had not waited). The host is a process killed by PID; the wait is bounded."""
    import json
    import os
    import signal
    import subprocess
    import sys

    server = serve()
    host = subprocess.Popen([sys.executable, "-c", HOST], stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    try:
        request = json.loads(host.stdout.readline())

        async def run():
            async with httpx.AsyncClient(timeout=60) as http:
                joining = asyncio.create_task(
                    http.post(
                        server.url + wire.INIT_WEIGHT_TRANSFER,
                        json=request,
                        headers={"Authorization": f"Bearer {server.control_token}"},
                    )
                )
                await asyncio.sleep(1.0)  # the server reached the host's store and waits for the group
                host.send_signal(signal.SIGKILL)
                return await asyncio.wait_for(joining, 30)  # bounded: far below the group's timeout

        response = asyncio.run(run())
    finally:
        host.kill()
        host.wait(10)
    assert response.status_code == 502 and "lost the weight-transfer master" in response.text, response.text
    assert httpx.get(server.url + wire.HEALTH, timeout=30).json()["weight_transfer"] is None


def test_remote_client_needs_a_group_and_the_control_token(serve, new_weights):
    server = serve()

    async def run():
        async with RemoteClient(server.url, control_token=server.control_token) as client:
            with pytest.raises(RuntimeError, match="init_weight_transfer"):
                await client.update_weights_broadcast(new_weights)
        async with RemoteClient(server.url) as anonymous:
            with pytest.raises(Exception) as denied:
                await anonymous.init_weight_transfer(timeout_s=5)
        return denied.value

    denied = asyncio.run(run())
    assert getattr(denied, "status", None) == 401
    assert httpx.get(server.url + wire.HEALTH, timeout=30).json()["weight_transfer"] is None


def test_local_client_makes_the_same_calls_in_process(model_dir, new_weights):
    async def run():
        engine = AsyncEngine.from_config(EngineConfig(model=str(model_dir), block_size=4))
        client = LocalClient(engine)
        info = await client.init_weight_transfer(max_chunk_bytes=CHUNK)
        before = weights_of(engine.engine)
        with pytest.raises(WeightUpdateError, match="model.norm.weight"):
            await client.update_weights_broadcast(with_wrong_shape(new_weights), version=2)
        restored = weights_of(engine.engine), await client.weight_version()
        version = await client.update_weights_broadcast(new_weights, version=3)
        await client.close_weight_transfer()
        await engine.close()
        return info, before, restored, version, weights_of(engine.engine)

    info, before, (restored, old_version), version, after = asyncio.run(run())
    assert info["world_size"] == 1 and equal(restored, before) and old_version == 0
    assert version == 3 and equal(after, dict(new_weights))
