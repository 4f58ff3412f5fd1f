"""The data-parallel training-step scenarios, run by 2 spawned FSDP ranks (gloo) and, for the
reference, by one unsharded worker on the whole batch (see test_step_data_parallel.py).

Each scenario is a step whose ranks get unequal shares: one rank with more micro-batches than the
other, one rank with nothing to train on (its groups have zero advantage) while the other runs an
old-log-probability and a reference forward, zero-advantage groups kept with another loss
reduction, long-tailed lengths that each rank cuts into a different number of micro-batches, a
critic for GAE, and the KL in the reward (what the batch-level part needs gathered from both ranks).
Plain SGD, so the updated parameters compare to 1e-5 (Adam's first step is about lr * sign(g)).
"""

from __future__ import annotations

import datetime
import os
from pathlib import Path

import torch
import torch.distributed as dist
from rl_support import rl_config

from inflight.rollout.task_generator import Trajectory, TrajectoryGroup
from inflight.tasks import Problem
from inflight.train.objective import uses_reference
from inflight.train.step import StepOptions, TrainingStep

BASE = ("trainer.policy.optimizer_config.weight_decay=0.0", "trainer.train_batch_size=4",
        "trainer.policy_mini_batch_size=4", "trainer.fully_async.num_parallel_generation_workers=8",
        "trainer.critic_mini_batch_size=2")
SCENARIOS: dict[str, dict] = {
    # 3 informative groups: rank 0 gets two (4 rows), rank 1 one (2 rows) -> 2 padding micro-batches;
    # stale tokens with one optimizer step: TIS against the training forward itself
    "uneven": dict(rewards=[[1, 0], [0, 1], [1, 1], [1, 0]], version=1, overrides=[
        "trainer.micro_train_batch_size_per_gpu=1"]),
    # 1 informative group: rank 1's share (the zero-variance group) trains nothing; two epochs of
    # stale tokens: an old-log-probability forward, and a reference forward for the KL
    "idle": dict(rewards=[[1, 0], [1, 1], [0, 0]], version=2, overrides=[
        "trainer.micro_train_batch_size_per_gpu=2", "trainer.update_epochs_per_batch=2",
        "trainer.algorithm.use_kl_loss=true", "trainer.algorithm.kl_loss_coef=0.5"]),
    # zero-variance groups kept: 2 mini-batches of 2 groups, rank 1 gets only the zero-advantage
    # ones; Dr. GRPO's reduction
    "kept-zero": dict(rewards=[[1, 0], [1, 1], [0, 1], [0, 0]], version=0, overrides=[
        "trainer.micro_train_batch_size_per_gpu=1", "trainer.fully_async.enabled=false",
        "trainer.algorithm.zero_variance_filter=false", "trainer.policy_mini_batch_size=2",
        "trainer.algorithm.loss_reduction=seq_mean_token_sum_norm", "trainer.algorithm.max_seq_len=24"]),
    # long-tailed lengths, micro-batches cut by length (every distinct length its own): the ranks'
    # shares cut into different numbers of micro-batches, each rank pads up to the larger
    "long-tail": dict(rewards=[[1, 0], [0, 1], [1, 0], [0, 1], [1, 0]], version=0,
                      lengths=(1, 1, 2, 3, 9, 20), options=dict(micro_batch_pass_tokens=0.0), overrides=[
        "trainer.micro_train_batch_size_per_gpu=3", "trainer.algorithm.loss_reduction=sequence_mean"]),
    # a critic on each rank (FSDP), its values gathered for GAE over the whole batch, trained in 2
    # critic mini-batches; dual-clip PPO with the entropy bonus
    "gae-critic": dict(rewards=[[1, 0], [0, 1], [1, 0]], version=0, critic=True, overrides=[
        "trainer.micro_train_batch_size_per_gpu=1", "trainer.algorithm.advantage_estimator=gae",
        "trainer.algorithm.lambd=0.95", "trainer.algorithm.policy_loss_type=dual_clip",
        "trainer.algorithm.use_entropy_loss=true", "trainer.algorithm.entropy_loss_coef=0.05",
        "trainer.critic.optimizer_config.lr=1e-3"]),
    # the KL in the reward (adaptive controller) to a perturbed reference: old and reference
    # log-probabilities gathered from both ranks (forward micro-batches) for REINFORCE++'s whitening
    "reward-kl": dict(rewards=[[1, 0], [0, 1], [1, 0]], version=1, perturb_ref=True, overrides=[
        "trainer.micro_train_batch_size_per_gpu=2", "trainer.algorithm.use_kl_in_reward=true",
        "trainer.algorithm.kl_loss_coef=0.2", "trainer.algorithm.kl_ctrl.type=adaptive",
        "trainer.algorithm.kl_ctrl.horizon=10", "trainer.recompute_old_logprobs_per_minibatch=false",
        "trainer.micro_forward_batch_size_per_gpu=2", "trainer.algorithm.advantage_estimator=reinforce++"]),
    # the shared-prefix forward: each rank packs its groups' rows (the prompt once per group) through
    # FSDP's full-logits forward, the reference's too; two epochs: an old-log-probability forward
    "shared-prefix": dict(rewards=[[1, 0, 1], [0, 1, 1], [1, 0, 0], [0, 1, 0]], version=1,
                          options=dict(shared_prefix_forward=True), overrides=[
        "trainer.shared_prefix_forward=true", "trainer.micro_train_batch_size_per_gpu=3",
        "trainer.update_epochs_per_batch=2", "trainer.algorithm.use_kl_loss=true",
        "trainer.algorithm.kl_loss_coef=0.5"]),
}  # fmt: skip
COMPARED_METRICS = ("loss", "clip_ratio", "kl", "is_ratio_mean", "is_ratio_max", "policy_entropy", "avg_kl",
                    "kl_loss_coef", "critic/critic_loss", "trained_tokens", "optimizer_steps")  # fmt: skip


def groups_of(
    rewards: list[list[float]], version: int, lengths: tuple[int, ...] = ()
) -> list[TrajectoryGroup]:
    """Groups of random responses (1 to 5 tokens, or drawn from `lengths`) sampled by weight
    version `version`."""
    gen = torch.Generator().manual_seed(7)
    groups = []
    for g, rs in enumerate(rewards):
        trajs = []
        for r in rs:
            pick = torch.randint(len(lengths), (1,), generator=gen) if lengths else None
            n = int(torch.randint(1, 6, (1,), generator=gen)) if pick is None else lengths[int(pick)]
            ids = torch.randint(2, 14, (n,), generator=gen).tolist()
            logprobs = (-torch.rand(n, generator=gen) - 1.0).tolist()
            trajs.append(Trajectory([5, 12, 7, 13], ids, logprobs, [version] * n, [1] * n, float(r), "stop"))
        groups.append(TrajectoryGroup(Problem(f"p{g}", "3+5=", "8"), trajs))
    return groups


def run_scenario(
    name: str, model_dir: str, out: str, make_worker, make_critic=None, extra: tuple[str, ...] = ()
) -> dict:
    """One step of scenario `name` on `make_worker(cfg)` workers (set up by the caller's recipe) and,
    where it has a critic, `make_critic(cfg)`; `extra` overrides on top."""
    sc = SCENARIOS[name]
    critic_path = [f"trainer.critic.model.path={model_dir}"] if sc.get("critic") else []
    cfg, _ = rl_config(Path(model_dir), Path(out), [*BASE, *sc["overrides"], *critic_path, *extra])
    worker = make_worker(cfg).setup()
    worker.optimizer = torch.optim.SGD([p for p in worker.model.parameters() if p.requires_grad], lr=0.5)
    reference = critic = None
    if uses_reference(cfg):
        reference = make_worker(cfg)
        reference.build_model()
        if sc.get("perturb_ref"):  # the same on every rank: a seeded draw over the full tensors
            gen = torch.Generator().manual_seed(3)
            named = [(n, t.clone()) for n, t in reference.iter_full_hf_tensors()]
            reference.load_hf_state((n, t + 0.05 * torch.randn(t.shape, generator=gen)) for n, t in named)
    if sc.get("critic"):
        critic = make_critic(cfg).setup()
        critic.optimizer = torch.optim.SGD([p for p in critic.model.parameters() if p.requires_grad], lr=0.5)
    step = TrainingStep(
        worker, cfg, 0, StepOptions(**{"shared_prefix_forward": False, **sc.get("options", {})}), reference,
        critic,
    )
    before = worker.full_hf_state_dict()
    metrics = step(groups_of(sc["rewards"], 0, sc.get("lengths", ())), sc["version"])
    state = worker.full_hf_state_dict()
    moved = max(float((state[k] - t).abs().max()) for k, t in before.items())
    critic_state = critic.full_hf_state_dict() if critic is not None else {}
    return {"state": state, "critic_state": critic_state, "moved": moved, "metrics": metrics, **step.counts}


def megatron_scenario(model_dir: str, out_dir: str) -> dict:
    """Scenario `uneven` on 2 Megatron ranks of one tensor-parallel group (one data-parallel rank:
    both must train on every row), then megatron's parallel state torn down."""
    from inflight.megatron.worker import MegatronPolicyWorker

    made = []

    def make(cfg):
        made.append(MegatronPolicyWorker(cfg, model_path=model_dir, tensor_parallel_size=2))
        return made[-1]

    try:
        # SkyRL's default recompute settings run megatron's activation checkpointing, which needs CUDA
        return run_scenario("uneven", model_dir, out_dir, make,
                            extra=("trainer.policy.megatron_config.transformer_config_kwargs={}",))
    finally:
        made[0].shutdown()


def run_rank(rank: int, port: int, model_dir: str, out_dir: str, backend: str = "fsdp") -> None:
    """A spawned rank: every scenario on FSDP, or `uneven` on Megatron; results saved for the test."""
    from inflight.train.critic import FSDPCriticWorker
    from inflight.train.workers.fsdp import FSDPPolicyWorker

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    # a rank left waiting in a collective fails after this instead of hanging the test
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=90))
    try:
        if backend == "megatron":
            results = {"uneven": megatron_scenario(model_dir, out_dir)}
        else:
            make = lambda cfg: FSDPPolicyWorker(cfg, model_path=model_dir)  # noqa: E731
            critic = lambda cfg: FSDPCriticWorker(cfg, model_path=model_dir)  # noqa: E731
            results = {name: run_scenario(name, model_dir, out_dir, make, critic) for name in SCENARIOS}
        if rank != 0:
            results = {
                name: {**result, "state": None, "critic_state": None} for name, result in results.items()
            }
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()
