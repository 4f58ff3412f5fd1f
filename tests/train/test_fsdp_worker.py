"""FSDP2 with 2 ranks on CPU (gloo, spawned processes): training steps and weight syncs through
WorkerDispatch into a real engine with requests in flight (see fsdp_session.py).

Oracles: torch (a single-process step on the same data gives the same weights as the sharded step;
the engine's parameters are torch.equal to the gathered full state), transformers (the engine's
logits equal a transformers model loaded with the trained full state dict; frozen requests continue
exactly as keep / recompute predict with the trained weights).
"""

from __future__ import annotations

import socket

import pytest
import torch
import torch.multiprocessing as mp
from conftest_weights import hf_greedy, tiny_models
from fsdp_session import LOGIT_PROMPT, TRAIN, run_rank, train_batch
from sync_scenarios import PROMPTS, check_fate, row_config
from transformers import AutoModelForCausalLM

from inflight.train import LocalPolicyWorker, TrainBatch


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return tiny_models(tmp_path_factory)


@pytest.fixture(scope="module")
def fsdp(models, tmp_path_factory):
    """Both ranks' results, by scenario."""
    out = tmp_path_factory.mktemp("fsdp")
    mp.spawn(run_rank, args=(free_port(), str(models.dir_a), str(out)), nprocs=2, join=True)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


def hf_with(models, state: dict[str, torch.Tensor]) -> torch.nn.Module:
    model = AutoModelForCausalLM.from_pretrained(models.dir_a, dtype=torch.float32)
    model.load_state_dict(state, strict=True)
    return model.eval()


def test_sharded_step_equals_a_single_process_step(models, fsdp):
    """torch as the oracle for the collectives: the same step on the concatenated data, unsharded."""
    worker = LocalPolicyWorker(row_config("async-keep", True, *TRAIN), model_path=str(models.dir_a)).setup()
    b0, b1 = train_batch(0, 1), train_batch(1, 1)
    # micro-batches of 1 on both sides: every sequence's loss weighs 1/4 of the step
    worker.train_step(
        TrainBatch(torch.cat([b0.input_ids, b1.input_ids]), torch.cat([b0.loss_mask, b1.loss_mask]))
    )
    reference = worker.full_hf_state_dict()
    state = fsdp[0]["logits"]["state"]
    assert set(state) == set(reference)
    for name, tensor in reference.items():
        # AdamW's first step is lr * g / (|g| + eps): summation order shows only where g is ~0
        torch.testing.assert_close(state[name], tensor, atol=1e-5, rtol=0, msg=name)
        assert not torch.equal(tensor, models.weights_a[name]), f"{name} did not train"
    assert fsdp[0]["logits"]["metrics"]["grad_norm"] == pytest.approx(
        fsdp[1]["logits"]["metrics"]["grad_norm"]
    )


def test_engine_logits_equal_the_trained_model_after_the_sync(models, fsdp):
    result = fsdp[0]["logits"]
    assert result["report"]["ok"] and result["engine_version"] == result["dispatch_version"] == 1
    assert fsdp[1]["logits"]["report"]["version"] == 1  # rank 1 learns the outcome
    assert all(result["weights_equal"].values())  # the engine holds the gathered full tensors, bit for bit
    hf = hf_with(models, result["state"])
    tokens = result["tokens"]
    assert tokens == hf_greedy(hf, LOGIT_PROMPT, 4)
    with torch.no_grad():
        reference = hf(torch.tensor([LOGIT_PROMPT + tokens[:-1]])).logits[0, len(LOGIT_PROMPT) - 1 :]
    torch.testing.assert_close(result["logits"], reference, atol=1e-5, rtol=0)
    assert not torch.allclose(
        reference,
        hf_with(models, models.weights_a)(torch.tensor([LOGIT_PROMPT + tokens[:-1]])).logits[
            0, len(LOGIT_PROMPT) - 1 :
        ],
    )


@pytest.mark.parametrize(
    ("name", "fate"),
    [
        ("seed", "recompute"),
        ("seed-prefix", "recompute"),
        ("seed-clear-off", "keep"),
        ("seed-broadcast", "recompute"),
    ],
)
def test_in_flight_requests_through_fsdp_dispatch(models, fsdp, name, fate):
    """The seed configuration (clear on, offload on, prefix caching off) and its variants."""
    result = fsdp[0][name]
    plan = result["plan"]
    assert result["report"]["ok"] and result["report"]["steps"] == plan.steps()
    assert plan.sleep and plan.reset_running_requests == (fate == "recompute")
    assert result["engine_version"] == 1 and fsdp[1][name]["report"]["version"] == 1
    assert result["stats"]["resets"] == (len(PROMPTS) if fate == "recompute" else 0)
    assert result["stats"]["kv_invalidated_resets"] == 0  # the plan reset them, not the backstop
    check_fate(result["outputs"], fate, models.hf_a, hf_with(models, result["state"]))


def test_failed_send_with_fsdp_leaves_old_weights_and_both_ranks_raise(models, fsdp):
    result = fsdp[0]["failure"]
    assert result["error"].startswith("TransportError") and "WeightSyncError" in fsdp[1]["failure"]["error"]
    assert result["engine_version"] == result["dispatch_version"] == 0
    assert result["stats"]["resets"] == 0 and result["stats"]["weight_updates"] == 0
    for rid, out in result["outputs"].items():  # none lost, all on model A
        assert out.finish_reason == "length" and set(out.token_weight_versions) == {0}
        assert out.output_token_ids == hf_greedy(models.hf_a, PROMPTS[rid], len(out.output_token_ids))
