"""The hf_generate backend through the same client as every server (`RemoteClient`), started the way
every backend is (`inflight serve --backend hf_generate`), with transformers' own model as the oracle."""

from __future__ import annotations

import asyncio
import sys

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from inflight.backends.registry import backend_entry
from inflight.client.errors import RemoteError
from inflight.client.remote import RemoteClient
from inflight.client.update import update_all_or_nothing
from inflight.config import load_config
from inflight.config.implemented import unimplemented
from inflight.config.job import JobConfig
from inflight.engine.request import SamplingParams
from inflight.orchestration.server_fleet import ServerFleet
from inflight.orchestration.servers import CONTROL_TOKEN_ENV, start_servers
from inflight.testing import LOCAL_CPU, LOCAL_CPU_TRAINER
from inflight.weight_sync.inprocess import InProcessTransport

TOKEN = "hf-generate-test"
PROMPTS = [[5, 9, 13, 2], [7, 7, 31]]


def _command(model: str):
    return lambda port: [
        sys.executable,
        "-m",
        "inflight.cli",
        "serve",
        "--backend",
        "hf_generate",
        "--model",
        model,
        "--threads",
        "1",
        "--port",
        str(port),
    ]


@pytest.fixture(scope="module")
def served(tiny_model_factory, tmp_path_factory):
    model = str(tiny_model_factory("qwen2", 0))
    fleet = ServerFleet(tmp_path_factory.mktemp("hf-servers"), env={CONTROL_TOKEN_ENV: TOKEN})
    (url,) = asyncio.run(fleet.start([_command(model)], backend_entry("hf_generate").start_timeout_s))
    yield model, url
    asyncio.run(fleet.close())


def _oracle(
    model_dir: str, prompt: list[int], n: int, weights: dict | None = None
) -> tuple[list[int], list[float]]:
    """transformers' greedy continuation of `prompt` and each token's log-probability."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    if weights is not None:
        model.load_state_dict(weights, strict=False)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             pad_token_id=0, eos_token_id=None)
        tokens = out[0, len(prompt):].tolist()
        logits = model(out).logits[0, len(prompt) - 1:-1]
    return tokens, torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens)[:, None])[:, 0].tolist()


def _run(coro_fn, url):
    async def go():
        client = RemoteClient(url, control_token=TOKEN)
        try:
            return await coro_fn(client)
        finally:
            await client.close()
    return asyncio.run(go())


def test_greedy_tokens_and_logprobs_are_transformers(served):
    model, url = served
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    outs = _run(lambda c: asyncio.gather(*(c.generate(p, params) for p in PROMPTS)), url)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        tokens, logprobs = _oracle(model, prompt, 6)
        assert out.output_token_ids == tokens and out.finish_reason == "length"
        assert out.token_weight_versions == [0] * 6
        scale = max(abs(x) for x in logprobs)
        assert max(abs(a - b) for a, b in zip(out.logprobs, logprobs, strict=True)) <= 1e-4 * scale


def test_a_weight_update_mid_request_through_the_client(served, tiny_model_factory):
    model, url = served
    other = load_file(str(tiny_model_factory("qwen2", 1) / "model.safetensors"))
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)

    async def scenario(client):
        running = asyncio.ensure_future(client.generate(PROMPTS[0], params))
        while not (await client.status())[url]["num_running"]:
            await asyncio.sleep(0.01)
        await client.pause("keep")  # frozen between two tokens
        await update_all_or_nothing(client, InProcessTransport(), other.items(), 1)
        await client.resume()
        first = await running
        after = await client.generate(
            PROMPTS[1], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        )
        return first, after, await client.weight_version()

    first, after, version = _run(scenario, url)
    assert version == 1 and after.token_weight_versions == [1] * 6
    switch = first.token_weight_versions.index(1)  # the tokens before the pause: old weights, then new
    assert 0 < switch and set(first.token_weight_versions[switch:]) == {1}
    assert first.output_token_ids[:switch] == _oracle(model, PROMPTS[0], switch)[0]
    # transformers with the new weights
    assert after.output_token_ids == _oracle(model, PROMPTS[1], 6, other)[0]


def test_a_broadcast_group_is_refused_by_the_server_and_by_validation(served):
    _, url = served
    with pytest.raises(RemoteError, match="chunk route only"):
        _run(lambda c: c.init_weight_transfer("127.0.0.1", 29555), url)
    hf = [
        "generator.inference_engine.backend=hf_generate",
        "generator.inference_engine.run_engines_locally=false",
        "generator.inference_engine.external_server_urls=[http://127.0.0.1:9]",
    ]
    refused = {v.key: v for v in unimplemented(load_config(None, [*LOCAL_CPU, *hf,
                                                                   "generator.inference_engine.weight_sync_backend=broadcast"]))}
    assert "is not a weight transport the hf_generate backend takes" in refused[
        "generator.inference_engine.weight_sync_backend"].rule
    assert "generator.inference_engine.weight_sync_backend" not in {
        v.key
        for v in unimplemented(
            load_config(None, [*LOCAL_CPU, *hf, "generator.inference_engine.weight_sync_backend=inprocess"])
        )
    }
    started = {
        v.key: v
        for v in unimplemented(
            load_config(
                None,
                [
                    *LOCAL_CPU,
                    "generator.inference_engine.backend=hf_generate",
                    "generator.inference_engine.weight_sync_backend=shm",
                ],
            )
        )
    }
    assert set(started) == {
        "generator.inference_engine.max_num_seqs",
        "generator.inference_engine.max_num_batched_tokens",
        "generator.inference_engine.kv_cache_memory_gib",
    }  # LOCAL_CPU's: no flag for them
    assert all("the hf_generate server command does not carry" in v.rule for v in started.values())
    assert (
        unimplemented(
            load_config(
                None,
                [
                    *LOCAL_CPU_TRAINER,
                    "generator.inference_engine.backend=hf_generate",
                    "generator.inference_engine.weight_sync_backend=shm",
                ],
            )
        )
        == []
    )


def test_a_run_starts_its_hf_generate_servers(tiny_model_factory, tmp_path):
    """`run_engines_locally=true` on hf_generate: the run starts one server per engine with the command its
    entry builds (`Backend.server_command`), each answering as transformers' own model; close stops them."""
    model = str(tiny_model_factory("qwen2", 0))
    cfg = load_config(
        None,
        [
            *LOCAL_CPU_TRAINER,
            "generator.inference_engine.backend=hf_generate",
            "generator.inference_engine.weight_sync_backend=shm",
            "generator.inference_engine.num_engines=2",
            "generator.inference_engine.model_dtype=float32",
            f"trainer.log_path={tmp_path}",
            f"trainer.policy.model.path={model}",
        ],
    )
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)

    async def scenario():
        servers = await start_servers(cfg, JobConfig(engine_threads=1), model, 3)
        try:
            outs = await asyncio.gather(*(servers.client.generate(p, params) for p in PROMPTS))
            return outs, await servers.client.weight_versions(), list(servers.fleet.launched)
        finally:
            await servers.close()

    outs, versions, launched = asyncio.run(scenario())
    assert len(versions) == 2 and set(versions.values()) == {3}
    for prompt, out in zip(PROMPTS, outs, strict=True):
        assert out.output_token_ids == _oracle(model, prompt, 5)[0] and out.token_weight_versions == [3] * 5
    assert all(s.proc.poll() is not None for s in launched)  # stopped on close
    assert all("serve --backend hf_generate" in s.log_path.read_text().splitlines()[0] for s in launched)
