"""Weight chunks as files in /dev/shm (`RemoteClient(shm_chunks=True)`, a server on this host): a full
update A -> B serves B (transformers B's greedy tokens), leaves no chunk file behind, and the route
refuses any name that is not a chunk file (400 naming `shm`) and keeps serving."""

from __future__ import annotations

import asyncio
import os

import httpx
import pytest
from safetensors.torch import load_file

from inflight.client import RemoteClient, update_weights, wire
from inflight.engine import SamplingParams
from inflight.testing.oracle import hf_greedy

PROMPT = [5, 6, 7, 8, 9]


def _chunk_files() -> set[str]:
    return {n for n in os.listdir(wire.SHM_DIR) if n.startswith(wire.CHUNK_FILE_PREFIX)}


def test_an_update_through_chunk_files_serves_the_new_model(serve, tiny_model_factory, hf_model_factory):
    srv = serve()
    model_b = tiny_model_factory("qwen2", 1)
    expected, _ = hf_greedy(hf_model_factory(model_b), PROMPT, 8)
    before = _chunk_files()

    async def scenario() -> tuple[int, list[int], list[int]]:
        async with RemoteClient(srv.url, control_token=srv.control_token, shm_chunks=True,
                                chunk_bytes=64 * 1024) as rc:  # several chunks
            version = await update_weights(rc, list(load_file(str(model_b / "model.safetensors")).items()))
            out = await rc.generate(PROMPT, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
            return version, out.output_token_ids, out.token_weight_versions

    version, tokens, versions = asyncio.run(scenario())
    assert tokens == expected and versions == [version] * 8
    assert _chunk_files() == before  # every chunk file was removed once sent


@pytest.mark.parametrize("name", ["../etc/passwd", "model.safetensors", wire.CHUNK_FILE_PREFIX + "missing"])
def test_the_chunk_route_reads_nothing_but_chunk_files(serve, name):
    srv = serve()
    headers = {"Authorization": f"Bearer {srv.control_token}"}
    assert httpx.post(srv.url + wire.WEIGHTS_BEGIN, headers=headers).status_code == 200
    try:
        answer = httpx.post(
            srv.url + wire.WEIGHTS_CHUNK, headers=headers, params={wire.CHUNK_FILE_PARAM: name}
        )
        assert answer.status_code == 400
        assert f"shm={name!r}" in answer.json()["error"]["message"]
    finally:
        assert httpx.post(srv.url + wire.WEIGHTS_ABORT, headers=headers).status_code == 200
    assert httpx.get(srv.url + wire.HEALTH).status_code == 200
