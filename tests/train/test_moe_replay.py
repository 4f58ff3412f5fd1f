"""Routing replay in the training forward of a mixture-of-experts policy (`inflight.train.moe_replay`).

Oracles: the native engine's own log-probabilities and routing record (itself held equal to
transformers in tests/engine/test_moe_oracle.py), and the experts transformers' MoE blocks actually
run, observed by a forward pre-hook on each `mlp.experts` (its second argument). A router-only
weight change between generation and training makes the trainer's routers choose other experts
than the rollout did: with replay the experts used are exactly the recorded ones, without they are
not, and the step's metrics say so.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from inflight.config import load_config
from inflight.engine import EngineConfig, LLMEngine, SamplingParams
from inflight.rollout.trajectory import Trajectory, TrajectoryGroup
from inflight.tasks.base import Problem
from inflight.testing import LOCAL_CPU, make_tiny_model
from inflight.train.moe_replay import moe_routers
from inflight.train.step import TrainingStep, build_batch
from inflight.train.workers.local import LocalPolicyWorker

ARCHS = {"qwen3_moe": dict(num_hidden_layers=3, mlp_only_layers=[1]),
         "qwen2_moe": dict(num_hidden_layers=2)}
PROMPTS = [[5, 9, 200, 31, 8, 77], list(range(40, 52)), [7, 3], [(13 * i) % 370 + 3 for i in range(20)]]
REPLAY = ["trainer.policy.megatron_config.moe_enable_routing_replay=true",
          "generator.inference_engine.enable_return_routed_experts=true"]


@pytest.fixture(scope="module")
def rollouts(tmp_path_factory):
    """rollouts(arch) -> (model dir, 4 groups of 2 seeded samples with their routing records), cached."""
    built: dict[str, tuple] = {}

    def get(arch: str):
        if arch not in built:
            path = make_tiny_model(tmp_path_factory.mktemp(arch), arch, **ARCHS[arch])
            engine = LLMEngine(EngineConfig(model=str(path), block_size=4))
            groups = []
            for i, prompt in enumerate(PROMPTS):
                params = [
                    SamplingParams(
                        max_tokens=6 + 2 * s, temperature=1.0, seed=10 * i + s, ignore_eos=True,
                        return_routed_experts=True,
                    )
                    for s in range(2)
                ]
                outs = [engine.generate([prompt], p)[0] for p in params]
                trajs = [
                    Trajectory(
                        list(prompt), o.output_token_ids, o.logprobs, o.token_weight_versions,
                        [1] * len(o.output_token_ids), float(s), o.finish_reason,
                        routed_experts=o.routed_experts, routed_experts_start=o.routed_experts_start,
                    )
                    for s, o in enumerate(outs)
                ]
                groups.append(TrajectoryGroup(Problem(f"p{i}", "", ""), trajs))
            built[arch] = path, groups
        return built[arch]

    return get


def _worker(path, *extra: str) -> LocalPolicyWorker:
    cfg = load_config(None, [*LOCAL_CPU, f"trainer.policy.model.path={path}", "trainer.train_batch_size=4",
                             "trainer.policy_mini_batch_size=2", "trainer.micro_train_batch_size_per_gpu=3",
                             "trainer.moe_logprob_gap_interval=1", "trainer.fully_async.enabled=false",
                             "trainer.algorithm.off_policy_correction.tis_ratio_type=null", *extra])
    return LocalPolicyWorker(cfg, model_path=str(path)).setup()


class ExpertsSeen:
    """The expert indices each sparse block's `experts` ran with, per forward: [B * S, MoE layers, k]."""

    def __init__(self, model: torch.nn.Module) -> None:
        blocks = [m for n, m in model.named_modules() if n.endswith(".mlp") and hasattr(m, "experts")]
        self.calls: list[list[torch.Tensor]] = []
        self.hooks = [b.experts.register_forward_pre_hook(self._seen(j)) for j, b in enumerate(blocks)]

    def _seen(self, layer: int):
        def hook(module, args):
            if layer == 0:
                self.calls.append([])
            self.calls[-1].append(args[1].detach().clone())
        return hook

    def last(self) -> torch.Tensor:
        return torch.stack(self.calls[-1], dim=1)


def _recorded(batch) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch's records flattened like the MoE blocks' rows, and where a position has one."""
    rows = batch.routed_experts.reshape(-1, *batch.routed_experts.shape[2:]).long()
    return rows, rows[:, 0, 0] >= 0


def _same_sets(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a.sort(-1).values == b.sort(-1).values).all(-1).all(-1)


@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("replay", [True, False])
def test_same_weights_in_fp32_give_the_engines_logprobs_and_experts(rollouts, arch, replay):
    """(a): the trainer's log-probabilities of the sampled tokens equal the engine's within 1e-5, with
    replay or without (same weights: the routers agree), and the experts run are the recorded ones."""
    path, groups = rollouts(arch)
    worker = _worker(path, *(REPLAY if replay else []))
    batch = build_batch(groups, None, pad_id=0)
    assert batch.routed_experts is not None and batch.routed_experts.dtype == torch.int16
    seen = ExpertsSeen(worker.model)
    logprobs = worker.logprobs(batch)
    keep = batch.loss_mask > 0
    np.testing.assert_allclose(
        logprobs[keep].numpy(), batch.rollout_logprobs[keep].numpy(), atol=1e-5, rtol=0
    )
    recorded, has = _recorded(batch)
    assert has.sum() == sum(
        len(t.prompt_ids) + len(t.response_ids) - 1 for g in groups for t in g.trajectories
    )
    assert bool(_same_sets(seen.last()[has], recorded[has]).all())
    assert worker.routing.replay is replay


@pytest.mark.parametrize("arch, lora", [("qwen3_moe", False), ("qwen2_moe", False), ("qwen2_moe", True)])
def test_after_a_router_only_change_replay_runs_exactly_the_recorded_experts(rollouts, arch, lora):
    """(b): new router weights choose other experts; with replay the experts run are exactly the
    recorded ones (in their slots) where a record is, the router's own elsewhere; without replay
    they differ from the record. Also under peft (LoRA on the routers and the experts)."""
    path, groups = rollouts(arch)
    batch = build_batch(groups, None, pad_id=0)
    recorded, has = _recorded(batch)
    used = {}
    adapters = ["trainer.policy.model.lora.rank=2"] if lora else []
    for replay in (True, False):
        worker = _worker(path, *adapters, *(REPLAY if replay else []))
        _move_routers(worker)
        seen = ExpertsSeen(worker.model)
        worker.logprobs(batch)
        used[replay] = seen.last()
    assert torch.equal(used[True][has], recorded[has])
    # no record (the rows' last positions, padding): the router's own choice; in the first MoE layer
    # both forwards see the same hidden states there (later ones see the replayed layers' outputs)
    assert torch.equal(used[True][~has][:, 0], used[False][~has][:, 0])
    differs = ~_same_sets(used[False][has], recorded[has])
    assert differs.float().mean() > 0.2


def _move_routers(worker: LocalPolicyWorker, seed: int = 7) -> None:
    """A router-only weight change: noise on every router's weight, nothing else touched."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for router in moe_routers(worker.model):
            router.weight.add_(torch.randn(router.weight.shape, generator=gen) * router.weight.std())


@pytest.mark.parametrize("replay", [True, False])
def test_the_steps_routing_metrics_and_logprob_gaps(rollouts, replay):
    """Through the training step (two mini-batches, micro-batches of 3 rows): the routing mismatch is
    0 with replay and > 0 without, the routers' own disagreement > 0 either way, and replay brings
    the trained tokens' log-probabilities closer to the rollout's."""
    path, groups = rollouts("qwen3_moe")
    worker = _worker(path, *(REPLAY if replay else []))
    _move_routers(worker)
    step = TrainingStep(worker, worker.cfg, pad_id=0)
    metrics = step(groups, policy_version=0)
    tokens = sum(len(t.prompt_ids) + len(t.response_ids) - 1 for g in groups for t in g.trajectories)
    assert metrics["moe/routed_tokens"] == tokens
    assert metrics["moe/router_disagreement"] > 0.2
    if replay:
        assert metrics["moe/routing_mismatch"] == 0.0
    else:
        assert metrics["moe/routing_mismatch"] == metrics["moe/router_disagreement"]
    assert metrics["moe/logprob_gap_replay"] < metrics["moe/logprob_gap_no_replay"]


def test_replay_trains_the_router_and_freeze_keeps_it(rollouts):
    """The gates over the recorded experts come from the current router: it gets a gradient, unless
    `freeze_moe_router` (then it is not even in the optimizer)."""
    path, groups = rollouts("qwen3_moe")
    batch = dataclasses.replace(build_batch(groups, None, pad_id=0))
    for freeze in (False, True):
        worker = _worker(
            path, *REPLAY, f"trainer.policy.megatron_config.freeze_moe_router={str(freeze).lower()}"
        )
        routers = moe_routers(worker.model)
        worker.forward_backward(batch, 1.0)
        grads = [r.weight.grad for r in routers]
        optimized = {id(p) for group in worker.optimizer.param_groups for p in group["params"]}
        if freeze:
            assert all(g is None for g in grads) and not any(id(r.weight) in optimized for r in routers)
        else:
            assert all(g is not None and g.abs().sum() > 0 for g in grads)


def test_gradient_checkpointing_recomputes_with_the_same_experts(rollouts):
    """A checkpointed layer's recomputation in the backward replays the record its forward did: the
    gradient equals the one without checkpointing."""
    path, groups = rollouts("qwen2_moe")
    batch = build_batch(groups, None, pad_id=0)
    grads = []
    for checkpointing in ("false", "true"):
        worker = _worker(path, *REPLAY, f"trainer.gradient_checkpointing={checkpointing}")
        _move_routers(worker)
        worker.model.train()
        worker.forward_backward(batch, 1.0)
        grads.append(torch.cat([p.grad.flatten() for p in worker.model.parameters() if p.grad is not None]))
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-5, atol=1e-6)
