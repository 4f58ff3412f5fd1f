"""`inflight train` with `generator.inference_engine.run_engines_locally=false` drives a native
`inflight serve` started outside the run: the run checks it, pushes its weights first, trains fully
async with in-flight updates through one RemoteClient (HTTP weight chunks), and the server ends up
serving exactly the trained weights (transformers on the run's export is the oracle)."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch
from rl_support import warm_model_dir
from transformers import AutoModelForCausalLM, AutoTokenizer

from inflight.backends.serve_command import native_command
from inflight.client.remote import RemoteClient
from inflight.engine.config import EngineConfig
from inflight.engine.request import SamplingParams
from inflight.orchestration.server_fleet import ServerFleet
from inflight.orchestration.servers import CONTROL_TOKEN_ENV
from inflight.testing import LOCAL_CPU_TRAINER
from inflight.testing.oracle import hf_greedy
from inflight.train.main import main

pytestmark = pytest.mark.timeout(300)
TOKEN = "external-test-token"
STEPS = 3


def _overrides(model_dir, url: str, out) -> list[str]:
    ie = "generator.inference_engine."
    return [
        *LOCAL_CPU_TRAINER, "job.task=addition", f"trainer.export_path={out}/exports",
        f"trainer.policy.model.path={model_dir}", "trainer.train_batch_size=4",
        "trainer.policy_mini_batch_size=4", "trainer.micro_train_batch_size_per_gpu=64",
        "trainer.fully_async.num_parallel_generation_workers=8", "trainer.eval_interval=0",
        "trainer.hf_save_interval=1", "generator.n_samples_per_prompt=4", f"{ie}run_engines_locally=false",
        f"{ie}external_server_urls=[{url}]", f"{ie}weight_sync_backend=inprocess", f"job.max_steps={STEPS}",
        "job.num_train=400", "job.num_eval=20", f"job.output_dir={out}", "job.plot=false",
        "job.tensorboard=false", "job.progress=false",
    ]  # fmt: skip


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return warm_model_dir(tmp_path_factory)


@pytest.mark.parametrize("ray", [False, True], ids=["local", "ray"])
def test_inflight_train_on_an_external_native_server(model_dir, tmp_path, monkeypatch, ray):
    if ray:
        pytest.importorskip("ray", reason="ray is not installed")
    engine = EngineConfig(model=str(model_dir), max_model_len=64, num_kv_blocks=128)
    fleet = ServerFleet(tmp_path / "elsewhere", env={CONTROL_TOKEN_ENV: TOKEN})
    try:
        (url,) = asyncio.run(fleet.start([lambda p: native_command(engine, p)], timeout_s=120))
        monkeypatch.setenv(CONTROL_TOKEN_ENV, TOKEN)
        if ray:  # only the CLI knows Ray: `inflight train --ray ...`
            from inflight.cli import main as cli_main

            assert cli_main(["train", "--ray", *_overrides(model_dir, url, tmp_path / "run")]) == 0
        else:
            assert main(_overrides(model_dir, url, tmp_path / "run")) == 0
        records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
        tok = AutoTokenizer.from_pretrained(model_dir)
        prompts = [tok.encode(text) for text in ("3+4=", "9+9=", "0+7=")]

        async def served():
            client = RemoteClient(url, control_token=TOKEN)
            try:
                params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
                outs = await asyncio.gather(*(client.generate(p, params) for p in prompts))
                return await client.weight_version(), outs
            finally:
                await client.close()

        version, outs = asyncio.run(served())
    finally:
        asyncio.run(fleet.close())
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    # the run pushed its weights first (version 1), then one in-flight update per step
    assert [r["weight_version"] for r in records] == list(range(2, STEPS + 2)) and version == STEPS + 1
    assert max(r["staleness_max"] for r in records) >= 1  # generation ran ahead of training
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "exports" / f"global_step_{STEPS}",
                                                    dtype=torch.float32).eval()
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    trained = dict(exported.named_parameters())
    assert any(not torch.equal(p, trained[n]) for n, p in base.named_parameters())  # RL changed the weights
    worst_trained = worst_base = 0.0
    for prompt, out in zip(prompts, outs, strict=True):
        tokens, logprobs = hf_greedy(exported, prompt, 6)
        assert out.output_token_ids == tokens
        assert set(out.token_weight_versions) == {version}
        worst_trained = max(worst_trained, *(abs(a - b) for a, b in zip(out.logprobs, logprobs, strict=True)))
        base_lp = hf_greedy(base, prompt, 6)[1]
        worst_base = max(worst_base, *(abs(a - b) for a, b in zip(out.logprobs, base_lp, strict=True)))
    assert worst_trained < 1e-4 < worst_base, (worst_trained, worst_base)  # the update took, not a 200


def test_unreachable_external_servers_fail_the_start_naming_the_server(model_dir, tmp_path):
    from inflight.client.errors import ServerUnavailableError
    from inflight.orchestration.server_fleet import free_port

    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    assert main(["--print-config", *_overrides(model_dir, url, tmp_path)]) == 0  # a valid config
    with pytest.raises(ServerUnavailableError, match=rf"{url}: GET /health: could not connect"):
        main(_overrides(model_dir, url, tmp_path))
