"""The broadcast-group routes of a live server on 127.0.0.1, driven over HTTP by a real rank 0 (a
`GroupHost` in this process) in the same torch.distributed (gloo) group: the update lands
bit-exactly and bumps the version; wrong shapes are refused without breaking the group, the old
weights come back on abort; a wrong world size, an unreachable master, a bad rank, a chunk without
a group and a missing control token are answered with OpenAI-style errors while the server keeps
serving."""

from __future__ import annotations

import socket
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from inflight.client import wire
from inflight.engine import EngineConfig
from inflight.engine.models.loader import iter_safetensors
from inflight.server.launch import serve_model
from inflight.weight_sync.group import GroupHost

CHUNK = 64 * 1024  # below the largest tensor (96 KiB): some tensors travel in pieces
GREEDY = {"max_tokens": 4, "temperature": 0.0, "ignore_eos": True}


def post(server, path: str, token: bool = True, **kwargs) -> httpx.Response:
    headers = {"Authorization": f"Bearer {server.control_token}"} if token else {}
    return httpx.post(server.url + path, headers=headers, timeout=60, **kwargs)


def assert_error(response: httpx.Response, status: int, code: str) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == code and error["message"] and error["type"]


def engine_weights(server) -> dict[str, torch.Tensor]:
    model = server.engine.engine.model
    params = dict(model.named_parameters())
    return {n: params[model.resolve(n)].detach().clone() for n in model.hf_parameter_names()}


def still_serving(server) -> list[int]:
    health = httpx.get(server.url + wire.HEALTH, timeout=30)
    assert health.status_code == 200 and health.json()["can_run"]
    body = {"prompt_token_ids": [5, 6, 7], "sampling_params": GREEDY}
    answer = httpx.post(server.url + wire.GENERATE, json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    return answer.json()["output_token_ids"]


def join(server, sender: GroupHost) -> dict:
    with ThreadPoolExecutor(1) as pool:
        answer = pool.submit(post, server, wire.INIT_WEIGHT_TRANSFER, json=sender.init_request(1))
        sender.connect()
        response = answer.result(timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def send(server, sender: GroupHost, named_tensors) -> list[httpx.Response]:
    """Each chunk: its metadata over HTTP while rank 0 broadcasts its bytes."""
    answers = []
    with ThreadPoolExecutor(1) as pool:
        for chunk in sender.chunks(named_tensors):
            answer = pool.submit(post, server, wire.WEIGHTS_BROADCAST, json=chunk.metadata())
            sender.send(chunk)
            answers.append(answer.result(timeout=60))
    return answers


@pytest.fixture(scope="module")
def new_weights(tiny_model_factory) -> dict[str, torch.Tensor]:
    return dict(iter_safetensors(tiny_model_factory("qwen2", seed=1)))


@pytest.fixture(scope="module")
def sender(server):
    sender = GroupHost(2, max_chunk_bytes=CHUNK, timeout_s=60)
    description = join(server, sender)
    assert description["rank"] == 1 and description["world_size"] == 2 and description["backend"] == "gloo"
    assert httpx.get(server.url + wire.HEALTH, timeout=30).json()["weight_transfer"]["rank"] == 1
    yield sender
    post(server, wire.DESTROY_WEIGHT_TRANSFER)
    sender.close()


def test_update_over_the_group_lands_bit_exactly_and_bumps_the_version(server, sender, new_weights):
    version = server.engine.weight_version + 3
    assert post(server, wire.WEIGHTS_BEGIN).status_code == 200
    answers = send(server, sender, new_weights.items())
    assert len(answers) > 1 and all(a.status_code == 200 for a in answers)
    assert sum(a.json()["num_tensors"] for a in answers) == len(new_weights)  # split pieces count once
    finish = post(server, wire.WEIGHTS_FINISH, params={"version": version})
    assert finish.status_code == 200 and finish.json()["weight_version"] == version
    loaded = engine_weights(server)
    assert loaded.keys() == new_weights.keys()
    assert all(torch.equal(loaded[n], t) for n, t in new_weights.items())
    still_serving(server)


def test_wrong_shape_is_refused_after_the_broadcast_and_abort_restores(server, sender, new_weights):
    before, version, tokens = engine_weights(server), server.engine.weight_version, still_serving(server)
    bad = dict(new_weights)
    bad["model.norm.weight"] = torch.ones(bad["model.norm.weight"].numel() + 1)
    assert post(server, wire.WEIGHTS_BEGIN).status_code == 200
    answers = send(server, sender, bad.items())
    refused = [a for a in answers if a.status_code != 200]
    assert len(refused) == 1
    assert_error(refused[0], 400, "weight_update_error")
    assert "model.norm.weight" in refused[0].json()["error"]["message"]
    assert post(server, wire.WEIGHTS_ABORT).json()["restored"] is True
    after = engine_weights(server)
    assert (
        all(torch.equal(after[n], t) for n, t in before.items()) and server.engine.weight_version == version
    )
    assert still_serving(server) == tokens
    # the group is still in step: the next update goes through
    assert post(server, wire.WEIGHTS_BEGIN).status_code == 200
    assert all(a.status_code == 200 for a in send(server, sender, new_weights.items()))
    assert post(server, wire.WEIGHTS_FINISH).json()["weight_version"] == version + 1


def test_a_second_init_without_override_is_a_conflict(server, sender):
    assert_error(post(server, wire.INIT_WEIGHT_TRANSFER, json=sender.init_request(1)), 409,
                 "weight_transfer_group_exists")  # fmt: skip


def group_kept(server) -> bool:
    return httpx.get(server.url + wire.HEALTH, timeout=30).json()["weight_transfer"] is not None


def test_wrong_world_size_is_refused_before_joining(server, sender):
    other = GroupHost(2, group_name="other", timeout_s=30)
    body = {**other.init_request(1), "world_size": 3, "override_existing": True}
    response = post(server, wire.INIT_WEIGHT_TRANSFER_ALIAS, json=body)
    assert_error(response, 400, "weight_transfer_mismatch")
    assert "world_size=2" in response.json()["error"]["message"]
    other.close()
    assert group_kept(server)
    still_serving(server)


def test_unreachable_master_is_a_502(server, sender):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there once closed
    body = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
            "group_name": "nowhere", "timeout_s": 1, "override_existing": True}  # fmt: skip
    assert_error(post(server, wire.INIT_WEIGHT_TRANSFER, json=body), 502, "weight_transfer_unreachable")
    assert group_kept(server)
    still_serving(server)


def test_rank_outside_the_group_is_a_400(server):
    body = {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 2, "world_size": 2}
    response = post(server, wire.INIT_WEIGHT_TRANSFER, json=body)
    assert_error(response, 400, "invalid_value")
    assert "rank_offset" in response.json()["error"]["message"]


def test_chunk_routes_need_a_group_and_a_well_formed_body(model_dir):
    server = serve_model(EngineConfig(model=str(model_dir), block_size=4), "tiny", control_token="t")
    server.control_token = "t"
    try:
        chunk = {"nbytes": 16, "tensors": [["model.norm.weight", "float32", [4], 0, 0, 4]]}
        assert_error(post(server, wire.WEIGHTS_BROADCAST, json=chunk), 409, "no_weight_transfer_group")
        bad = {"nbytes": 8, "tensors": [["model.norm.weight", "float32", [4], 0, 0, 4]]}
        assert_error(post(server, wire.WEIGHTS_BROADCAST, json=bad), 400, "invalid_value")
        bad_dtype = {"nbytes": 16, "tensors": [["model.norm.weight", "float99", [4], 0, 0, 4]]}
        assert_error(post(server, wire.WEIGHTS_BROADCAST, json=bad_dtype), 400, "invalid_value")
        still_serving(server)
    finally:
        server.stop()


@pytest.mark.parametrize(
    "path", [wire.INIT_WEIGHT_TRANSFER, wire.WEIGHTS_BROADCAST, wire.DESTROY_WEIGHT_TRANSFER]
)
def test_group_routes_require_the_control_token(server, path):
    assert_error(post(server, path, token=False, json={}), 401, "missing_control_token")
