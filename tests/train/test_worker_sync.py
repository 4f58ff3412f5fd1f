"""Both policy backends with 2 ranks on CPU (gloo, spawned processes), through LocalPolicy into a
real engine with requests in flight (see sync_session.py): FSDP2 (data parallel over both ranks)
and Megatron (tensor parallel size 2, set by trainer.policy.megatron_config.tensor_model_parallel_size).
One spawn per backend runs every scenario once.

Oracles: torch (a single-process step on the same data gives the weights the sharded step gave;
the engine's parameters are torch.equal to the gathered full state), transformers (the engine's
logits equal a transformers model loaded with the trained full state dict; frozen requests continue
exactly as keep / recompute predict with the trained weights).
"""

from __future__ import annotations

import socket

import pytest
import torch
import torch.multiprocessing as mp
from conftest_weights import hf_greedy
from sync_scenarios import PROMPTS, ROWS, check_colocated, check_fate, check_row, row_config
from sync_session import (
    LOGIT_PROMPT,
    ROW_SCENARIO,
    SCENARIOS,
    TRAIN,
    data_parallel_size,
    run_rank,
    train_batch,
)
from transformers import AutoModelForCausalLM

from inflight.train import LocalPolicyWorker, TrainBatch

BACKENDS = ["fsdp", "megatron"]
# Adam's first step is lr * g / (|g| + eps): summation order shows only where g is ~0; megatron's
# tensor-parallel matmuls sum in another order than transformers', so more of those show
STEP_ATOL = {"fsdp": 1e-5, "megatron": 1e-3}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]



@pytest.fixture(scope="module", params=BACKENDS)
def ranks(request, models, tmp_path_factory):
    """(backend, both ranks' results by scenario): one spawn per backend."""
    backend = request.param
    if backend == "megatron":
        pytest.importorskip(
            "megatron.core", reason="megatron-core is not installed: pip install -e '.[megatron]'"
        )
    out = tmp_path_factory.mktemp(backend)
    mp.spawn(run_rank, args=(backend, free_port(), str(models.dir_a), str(out)), nprocs=2, join=True)
    return backend, [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


_HF: dict[int, tuple[dict, torch.nn.Module]] = {}


def hf_with(models, state: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A transformers model holding `state` (cached; the state is kept so its id stays unique)."""
    if id(state) not in _HF:
        model = AutoModelForCausalLM.from_pretrained(models.dir_a, dtype=torch.float32)
        model.load_state_dict(state, strict=True)
        _HF[id(state)] = (state, model.eval())
    return _HF[id(state)][1]


def sent_state(results: dict, name: str) -> dict[str, torch.Tensor]:
    """The full state the scenario's sync sent (that of the last scenario that trained)."""
    return results[results[name]["weights_of"]]["state"]


def test_backend_settings_come_from_the_config(ranks):
    backend, (r0, r1) = ranks
    assert r0["tp"] == r1["tp"] == (2 if backend == "megatron" else 1)


def test_sharded_step_equals_a_single_process_step(models, ranks):
    """torch as the oracle for the collectives: the same step on the data of every data-parallel
    rank, concatenated and unsharded (micro-batches of 1 on both sides: each sequence weighs alike)."""
    backend, (r0, r1) = ranks
    worker = LocalPolicyWorker(row_config("async-keep", True, *TRAIN), model_path=str(models.dir_a)).setup()
    shares = [train_batch(d, 1) for d in range(data_parallel_size(backend))]
    worker.train_step(
        TrainBatch(torch.cat([b.input_ids for b in shares]), torch.cat([b.loss_mask for b in shares]))
    )
    reference = worker.full_hf_state_dict()
    state = r0["logits"]["state"]
    assert set(state) == set(reference)
    for name, tensor in reference.items():
        torch.testing.assert_close(state[name], tensor, atol=STEP_ATOL[backend], rtol=0, msg=name)
        assert not torch.equal(tensor, models.weights_a[name]), f"{name} did not train"
    assert r0["logits"]["metrics"]["grad_norm"] == pytest.approx(r1["logits"]["metrics"]["grad_norm"])


def test_engine_logits_equal_the_trained_model_after_the_sync(models, ranks):
    _, (r0, r1) = ranks
    result = r0["logits"]
    assert result["report"]["ok"] and result["engine_version"] == result["dispatch_version"] == 1
    assert r1["logits"]["report"]["version"] == 1  # rank 1 learns the outcome
    assert all(result["weights_equal"].values())  # the engine holds the gathered full tensors, bit for bit
    tokens, hf = result["tokens"], hf_with(models, result["state"])
    assert tokens == hf_greedy(hf, LOGIT_PROMPT, 4)
    ids = torch.tensor([LOGIT_PROMPT + tokens[:-1]])
    with torch.no_grad():
        reference = hf(ids).logits[0, len(LOGIT_PROMPT) - 1 :]
        before = models.hf_a(ids).logits[0, len(LOGIT_PROMPT) - 1 :]
    torch.testing.assert_close(result["logits"], reference, atol=1e-5, rtol=0)
    assert not torch.allclose(reference, before)


@pytest.mark.parametrize(
    ("name", "fate"),
    [("seed", "recompute"), ("seed-prefix", "recompute"), ("seed-clear-off", "keep"),
     ("seed-broadcast", "recompute")],
)  # fmt: skip
def test_in_flight_requests_through_dispatch(models, ranks, name, fate):
    """The seed configuration (clear on, offload on, prefix caching off) and its variants."""
    _, (r0, r1) = ranks
    result = r0[name]
    plan = result["plan"]
    assert result["report"]["ok"] and result["report"]["steps"] == plan.steps()
    assert plan.sleep and plan.reset_running_requests == (fate == "recompute")
    assert result["engine_version"] == 1 and r1[name]["report"]["version"] == 1
    assert result["stats"]["resets"] == (len(PROMPTS) if fate == "recompute" else 0)
    assert result["stats"]["kv_invalidated_resets"] == 0  # the plan reset them, not the backstop
    check_fate(result["outputs"], fate, models.hf_a, hf_with(models, result["state"]))


@pytest.mark.parametrize("row", [r for r in ROWS if r != "colocated"])
def test_plan_row_with_requests_in_flight(models, ranks, row):
    """Every non-colocated row of the plan table, with prefix caching on: steps, resets, stale
    cache blocks and how the frozen requests end, as for the single-process worker."""
    _, (r0, r1) = ranks
    name = ROW_SCENARIO[row]
    result, state = r0[name], sent_state(r0, name)
    assert SCENARIOS[name].row == row and SCENARIOS[name].prefix
    fate = check_row(result["plan"], result["report"], result["stats"], result["stale"], True, state)
    assert result["engine_version"] == result["dispatch_version"] == 1 and r1[name]["report"]["version"] == 1
    check_fate(result["outputs"], fate, models.hf_a, hf_with(models, state))


def test_colocated_row(models, ranks):
    _, (r0, r1) = ranks
    result = r0["row-colocated"]
    check_colocated(
        result["report"],
        result["plan"],
        True,
        result["after"],
        hf_with(models, sent_state(r0, "row-colocated")),
    )
    assert r1["row-colocated"]["report"]["version"] == 1


def test_failed_send_leaves_old_weights_and_both_ranks_raise(models, ranks):
    _, (r0, r1) = ranks
    result = r0["failure"]
    assert result["error"].startswith("TransportError") and "WeightSyncError" in r1["failure"]["error"]
    assert result["engine_version"] == result["dispatch_version"] == 0
    assert result["stats"]["resets"] == 0 and result["stats"]["weight_updates"] == 0
    for rid, out in result["outputs"].items():  # none lost, all on model A
        assert out.finish_reason == "length" and set(out.token_weight_versions) == {0}
        assert out.output_token_ids == hf_greedy(models.hf_a, PROMPTS[rid], len(out.output_token_ids))
