"""The vLLM backend's broadcast group and memory mapping without vLLM: the shim's own routes over a
stand-in for vLLM's `AsyncLLM` (it records the calls the shim makes), reached in-process by the
project's `RemoteClient` (ASGI transport), with the trainer's side the project's own `GroupHost`.

- the group protocol is one implementation: `inflight/weight_sync/{chunking,group}.py` import only
  the standard library and torch, and the shim loads those very files by path;
- a gloo broadcast update lands whole: the file the shim hands vLLM's reload holds exactly the
  sender's tensors (tensors larger than the group's buffer travel in pieces);
- every chunk's broadcast is joined, also when the update then refuses it, so the group stays in step;
- sleep/wake on a server whose vLLM frees memory (CUDA's sleep mode) become vLLM's sleep level 1 and
  wake_up, the KV pool only when the scheduler runs again.
(The live server: test_vllm_server.py; a training run over it: tests/train/test_vllm_training.py.)
"""

from __future__ import annotations

import ast
import asyncio
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch
from fastapi import FastAPI
from safetensors.torch import load_file

from inflight.backends.vllm import shared
from inflight.backends.vllm.broadcast import BroadcastMember
from inflight.backends.vllm.control import build_router
from inflight.backends.vllm.errors import install_error_handlers
from inflight.backends.vllm.state import Lifecycle
from inflight.backends.vllm.weights import WeightStage
from inflight.client import RemoteClient, routes
from inflight.client.errors import RemoteEngineStateError, RemoteInvalidRequestError, RemoteWeightUpdateError
from inflight.weight_sync.chunking import iter_chunks
from inflight.weight_sync.group import GroupHost

URL = "http://shim"


class FakeVllm:
    """The `AsyncLLM` calls the shim makes, recorded in order (no model: a reload is a recorded call)."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    async def pause_generation(self, mode: str = "abort", clear_cache: bool = True) -> None:
        self.calls.append(("pause", mode, clear_cache))

    async def resume_generation(self) -> None:
        self.calls.append(("resume",))

    async def reset_prefix_cache(
        self, reset_running_requests: bool = False, reset_connector: bool = False
    ) -> bool:
        self.calls.append(("reset_prefix_cache", reset_running_requests))
        return True

    async def sleep(self, level: int = 1, mode: str = "abort") -> None:
        self.calls.append(("sleep", level, mode))

    async def wake_up(self, tags: list[str] | None = None) -> bool:
        self.calls.append(("wake_up", tags))
        return True

    async def collective_rpc(self, method, kwargs=None):
        self.calls.append(("collective_rpc", method if isinstance(method, str) else method.__name__, kwargs))
        return []

    async def update_weight_version(self, version: str) -> None:
        self.calls.append(("update_weight_version", version))

    async def abort(self, ids) -> None:
        self.calls.append(("abort", list(ids)))

    def get_num_unfinished_requests(self) -> int:
        return 0

    async def check_health(self) -> None:
        return None


def shim(model: Path, frees_memory: bool = False) -> tuple[FakeVllm, Lifecycle, WeightStage, RemoteClient]:
    """The shim's routes over a FakeVllm, and a RemoteClient that reaches them in-process."""
    engine, stage = FakeVllm(), WeightStage(model)
    life = Lifecycle(engine, frees_memory=frees_memory)
    app = FastAPI()
    app.include_router(build_router(life, stage, routes, api_key=None, control_token=None, max_model_len=64,
                                    member=BroadcastMember("cpu")))
    install_error_handlers(app)
    client = RemoteClient(URL, transport=httpx.ASGITransport(app=app), health_check_interval_s=None)
    return engine, life, stage, client


def test_the_group_protocol_files_import_only_the_standard_library_and_torch():
    """The shim runs them in vLLM's interpreter, which has no `inflight`: an import of anything else
    would break the vLLM backend's broadcast (only on vLLM, where the project's tests cannot see it)."""
    for name in shared.FILES:
        tree = ast.parse((shared.WEIGHT_SYNC_DIR / f"{name}.py").read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                tops = [a.name.split(".")[0] for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                tops = [node.module.split(".")[0]]
            elif isinstance(node, ast.ImportFrom):  # relative: only the other file loaded beside it
                assert node.level == 1 and node.module in shared.FILES, (name, node.module)
                continue
            else:
                continue
            for top in tops:
                assert top in sys.stdlib_module_names or top in ("torch", "__future__"), (name, top)
    probe = ("import importlib.util, sys; "
             f"spec = importlib.util.spec_from_file_location('probe', {str(Path(shared.__file__))!r}); "
             "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); "
             "assert m.group.GroupMember and m.chunking.Reassembler; "
             "print(sorted(n for n in sys.modules if n == 'inflight' or n.startswith('inflight.')))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, cwd="/")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"  # loaded by path, nothing of the inflight package came with it


def test_a_gloo_broadcast_update_lands_whole_and_a_refused_chunk_keeps_the_group(tiny_model_factory):
    model_a, model_b = tiny_model_factory("qwen2", 0), tiny_model_factory("qwen2", 1)
    weights_b = load_file(str(model_b / "model.safetensors"))
    biggest = max(t.numel() * t.element_size() for t in weights_b.values())

    async def run():
        engine, life, stage, client = shim(model_a)
        try:
            info = await client.init_weight_transfer(
                "127.0.0.1", 0, backend="gloo", max_chunk_bytes=biggest // 3
            )
            health = (await client.health())[URL]
            version = await client.update_weights_broadcast(list(weights_b.items()))
            landed = load_file(str(stage.complete_dir / "model.safetensors"))
            # a chunk outside begin/finish: joined, then refused (409); the group stays in step
            group = client.weight_group
            chunk = next(iter_chunks([("model.norm.weight", weights_b["model.norm.weight"])], biggest))
            with pytest.raises(RemoteEngineStateError, match="no weight update is open"):
                await group.send_chunk(client, chunk)
            # an unknown name: the update is refused and aborted, the last complete weights stay
            with pytest.raises(RemoteWeightUpdateError, match="unknown parameter 'model.nope'"):
                await client.update_weights_broadcast([("model.nope", torch.ones(3)), *weights_b.items()])
            kept = (life.weight_version, stage.complete_dir)
            # an update cut off inside a split tensor: finish names it, abort keeps the last weights
            await client.begin_weight_update()
            first = next(
                c for c in group.chunks(list(weights_b.items())) if not all(m.whole for m in c.metas)
            )
            await group.send_chunk(client, first)
            with pytest.raises(RemoteWeightUpdateError, match="split tensors never completed"):
                await client.finish_weight_update(5)
            assert await client.abort_weight_update() is True
            # the same group still works
            again = await client.update_weights_broadcast(list(weights_b.items()))
            await client.close_weight_transfer()
            after = (await client.health())[URL]["weight_transfer"]
            return info, health, version, landed, kept, again, after, engine.calls, stage
        finally:
            await client.close()

    info, health, version, landed, kept, again, after, calls, stage = asyncio.run(run())
    try:
        assert info["backend"] == "gloo" and info["world_size"] == 2 and info["ranks"] == {URL: 1}
        assert health["weight_transfer"]["rank"] == 1 and health["weight_transfer"]["backend"] == "gloo"
        assert version == 1 and set(landed) == set(weights_b)
        assert all(torch.equal(landed[k], t) for k, t in weights_b.items())  # bit for bit what was sent
        assert kept[0] == 1 and again == 2 and after is None
        reloads = [c for c in calls if c[0] == "collective_rpc" and c[1] == "reload_weights"]
        assert len(reloads) == 2 and ("update_weight_version", "2") in calls
    finally:
        stage.close()


def test_the_init_route_refuses_a_group_it_does_not_match(tiny_model_factory):
    """A wrong world size, or nccl on a CPU server: 400 naming the field, and no one waits for it."""

    async def run():
        _, _, stage, client = shim(tiny_model_factory("qwen2", 0))
        host = GroupHost(3, backend="gloo", timeout_s=30)
        nccl = GroupHost(2, backend="nccl", timeout_s=30)
        try:
            server = client.clients[URL]
            with pytest.raises(RemoteInvalidRequestError, match="world_size=2 but the group") as wrong:
                await server.join_weight_group({**host.init_request(1), "world_size": 2})
            with pytest.raises(RemoteInvalidRequestError, match="nccl backend needs a CUDA engine") as cpu:
                await server.join_weight_group(nccl.init_request(1))
            return wrong.value, cpu.value
        finally:
            host.close()
            nccl.close()
            await client.close()
            stage.close()

    wrong, cpu = asyncio.run(run())
    assert wrong.status == cpu.status == 400


def test_sleep_and_wake_move_memory_where_vllm_frees_it(tiny_model_factory):
    """With vLLM's sleep mode (CUDA): our sleep is vLLM's sleep level 1 once, the weights wake for
    the update, the KV pool with the scheduler at resume; an update cannot finish into sleeping
    weights; offload_kv=true, which level 1 cannot keep, is refused."""
    model = tiny_model_factory("qwen2", 0)
    weights = load_file(str(model / "model.safetensors"))

    async def run():
        engine, life, stage, client = shim(model, frees_memory=True)
        try:
            with pytest.raises(RemoteInvalidRequestError, match="offload_kv=true cannot be kept"):
                await client.sleep(offload_kv=True)
            await client.pause("keep")
            await client.sleep(offload_kv=False)
            await client.sleep(offload_kv=False)  # asleep already: vLLM is not asked again
            slept = list(engine.calls)
            await client.begin_weight_update()
            await client.load_weights(list(weights.items()))
            with pytest.raises(RemoteEngineStateError, match="weights are asleep in vLLM"):
                await client.finish_weight_update(1)
            await client.wake_up(["weights"])
            await client.finish_weight_update(1)
            await client.wake_up(["kv_cache"])
            asleep_before_resume = sorted(life.asleep)
            mark = len(engine.calls)
            await client.resume()
            return slept, asleep_before_resume, engine.calls, mark, life
        finally:
            await client.close()
            stage.close()

    slept, asleep_before_resume, calls, mark, life = asyncio.run(run())
    assert [c for c in slept if c[0] == "sleep"] == [("sleep", 1, "keep")]
    assert slept.index(("pause", "keep", False)) < slept.index(("sleep", 1, "keep"))
    assert ("wake_up", ["weights"]) in calls[:mark] and asleep_before_resume == ["kv_cache"]
    assert calls[mark:] == [("reset_prefix_cache", True), ("wake_up", ["kv_cache"]), ("resume",)]
    assert life.asleep == set() and life.can_run and life.stats.kv_invalidated_resets == 0


def test_sleep_moves_nothing_where_vllm_cannot_free_memory(tiny_model_factory):
    """On CPU (no sleep mode) sleep keeps our contract by its flags alone: vLLM's sleep is never called."""

    async def run():
        engine, life, stage, client = shim(tiny_model_factory("qwen2", 0))
        try:
            await client.sleep(offload_kv=True)  # = keep: accepted here
            await client.wake_up()
            return engine.calls, life
        finally:
            await client.close()
            stage.close()

    calls, life = asyncio.run(run())
    assert not [c for c in calls if c[0] in ("sleep", "wake_up")] and life.update == "invalid"
