"""Shared pieces of the tests of the training step's objective: tiny policy / teacher models, groups
whose rollout log-probabilities are near the model's own (so importance ratios are near 1), a step
run with a gradient spy, and the direct computation of the same gradient from transformers' logits
and `inflight.algorithms`' functions, which the step must equal."""

from __future__ import annotations

from pathlib import Path

import torch
from rl_support import rl_config

from inflight.algorithms import batch_normalize_advantages as skyrl_normalize
from inflight.algorithms import (
    get_advantage_estimator,
    get_policy_loss,
    kl_loss,
    masked_mean,
    prompt_boundaries,
    scale_advantages,
)
from inflight.rollout.task_generator import Trajectory, TrajectoryGroup
from inflight.tasks import Problem
from inflight.train import LocalPolicyWorker
from inflight.train.step import TrainingStep

BASE = (  # 3 prompts x 4 samples, one optimizer step, no correction unless a case asks
    "trainer.train_batch_size=3", "trainer.policy_mini_batch_size=3", "generator.n_samples_per_prompt=4",
    "trainer.fully_async.num_parallel_generation_workers=6",
    "trainer.algorithm.off_policy_correction.tis_ratio_type=null",
    "trainer.algorithm.zero_variance_filter=true", "trainer.policy.optimizer_config.weight_decay=0.0",
    "trainer.critic_mini_batch_size=3",
)  # fmt: skip
REWARDS = [[1.0, 0.0, 0.0, 1.0], [0.0, 0.5, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0]]  # the last: zero variance


def make_groups(model_dir: Path, version: int, rewards=REWARDS, seed: int = 0, noise: float = 0.2,
                observation: bool = True) -> list[TrajectoryGroup]:
    """Groups of random responses (2 to 6 tokens; with `observation`, some rows with an environment
    stretch of loss mask 0 inside), rollout log-probabilities = the model's own + N(0, noise)."""
    from inflight.train.step import build_batch

    gen = torch.Generator().manual_seed(seed)
    groups = []
    for g, rs in enumerate(rewards):
        trajs = []
        for r in rs:
            n = int(torch.randint(2, 7, (1,), generator=gen))
            ids = torch.randint(2, 60, (n,), generator=gen).tolist()
            mask = [1] * n
            if observation and n >= 5 and torch.rand(1, generator=gen) < 0.5:
                mask[2:4] = [0, 0]
            versions = [version if m else -1 for m in mask]
            trajs.append(Trajectory([5, 12, 7, 13], ids, [0.0] * n, versions, mask, r, "stop"))
        groups.append(TrajectoryGroup(Problem(f"p{g}", "3+5=", "8"), trajs, epoch=0))
    cfg, _ = rl_config(model_dir, Path("/tmp"), list(BASE))
    worker = LocalPolicyWorker(cfg, model_path=str(model_dir)).setup()
    batch = build_batch(groups, None, 0)
    own = worker.logprobs(batch)
    for row, t in enumerate(t for g in groups for t in g.trajectories):
        p = len(t.prompt_ids)
        lp = own[row, p : p + len(t.response_ids)] + noise * torch.randn(len(t.response_ids), generator=gen)
        t.logprobs = lp.tolist()
    return groups


def step_grads(model_dir: Path, out: Path, overrides, groups, version: int, ref_dir: Path | None = None,
               critic=None) -> tuple[list[torch.Tensor], dict]:
    """The gradient the step's first optimizer step takes (and the step's metrics)."""
    cfg, _ = rl_config(model_dir, out, [*BASE, *overrides])
    worker = LocalPolicyWorker(cfg).setup()
    reference = None
    if ref_dir is not None:
        reference = LocalPolicyWorker(cfg, model_path=str(ref_dir), role="ref")
        reference.build_model()
    step = TrainingStep(worker, cfg, 0, reference=reference, critic=critic)
    captured, original = {}, worker.optimizer_step

    def spy():
        captured.setdefault("grads", [p.grad.clone() for p in worker.model.parameters()])
        return original()

    worker.optimizer_step = spy
    metrics = step(groups, version)
    return captured.get("grads"), metrics


def direct_grads(model_dir: Path, out: Path, overrides, groups, rows: slice | None = None,
                 ref_dir: Path | None = None, values: torch.Tensor | None = None,
                 record: dict | None = None) -> list[torch.Tensor]:
    """The same gradient computed at once on the mini-batch `rows` (default all) from transformers'
    logits: SkyRL's token rewards, the zero-variance filter, the estimator, the scaling of the
    reduction, the registered policy loss, the KL loss and the entropy bonus (SkyRL's worker's: the
    row-weighted mean over micro-batches of `micro_train_batch_size_per_gpu` consecutive rows of their
    token means; its value goes into `record["policy_entropy"]`). `values` [B, T]: the critic's, for
    `gae`."""
    from inflight.train.step import build_batch

    cfg, _ = rl_config(model_dir, out, [*BASE, *overrides])
    alg = cfg.trainer.algorithm
    worker = LocalPolicyWorker(cfg).setup()
    trajs = [t for g in groups for t in g.trajectories]
    batch = build_batch(groups, None, 0)
    starts = [len(t.prompt_ids) for t in trajs]
    ends = [s + len(t.response_ids) for s, t in zip(starts, trajs, strict=True)]
    uids = [i for i, g in enumerate(groups) for _ in g.trajectories]
    mask = batch.loss_mask.clone()
    for i, g in enumerate(groups):  # SkyRL's zero-variance filter: equal rewards -> loss mask 0
        if alg.zero_variance_filter and max(g.rewards) - min(g.rewards) <= alg.zero_variance_filter_tol:
            mask[[r for r, u in enumerate(uids) if u == i]] = 0.0
    # response layout [B, R] (SkyRL's): column j = response token j
    width = max(e - s for s, e in zip(starts, ends, strict=True))
    rewards, response, lmask, critic = (torch.zeros(len(trajs), width) for _ in range(4))
    for r, (s, e, t) in enumerate(zip(starts, ends, trajs, strict=True)):
        rewards[r, e - s - 1] = t.reward
        response[r, : e - s] = 1.0
        lmask[r, : e - s] = mask[r, s:e]
        if values is not None:
            critic[r, : e - s] = values[r, s:e]
    adv, _ = get_advantage_estimator(alg.advantage_estimator)(
        token_level_rewards=rewards, response_mask=response, index=uids,
        values=critic if values is not None else None, gamma=alg.gamma,
        lambd=alg.lambd, grpo_norm_by_std=alg.grpo_norm_by_std, config=alg)
    if alg.advantage_batch_normalize:
        adv = skyrl_normalize(adv, response)
    rows = rows or slice(0, len(trajs))
    local_uids = uids[rows]
    scaled = scale_advantages(
        adv[rows], lmask[rows], alg.loss_reduction,
        micro_batch_size=cfg.trainer.micro_train_batch_size_per_gpu, max_seq_len=alg.max_seq_len,
        prompt_boundaries=prompt_boundaries(local_uids),
    )
    full = torch.zeros_like(mask[rows])
    for r, (s, e) in enumerate(zip(starts[rows], ends[rows], strict=True)):
        full[r, s:e] = scaled[r, : e - s]
    part = batch.select(torch.arange(len(trajs))[rows])
    m = mask[rows]
    temperature = cfg.generator.sampling_params.temperature
    worker.model.train()
    logits = (
        worker.model(input_ids=part.input_ids, attention_mask=part.attention_mask).logits[:, :-1]
        / temperature
    )
    log_p = torch.log_softmax(logits.float(), dim=-1)
    logprobs = torch.nn.functional.pad(log_p.gather(-1, part.input_ids[:, 1:, None]).squeeze(-1), (1, 0))
    with torch.no_grad():
        old = logprobs.detach()  # the step starts from these weights
    needs_old = alg.policy_loss_type not in ("rollout_is", "dppo") or alg.off_policy_correction.tis_ratio_type
    loss, _ = get_policy_loss(alg.policy_loss_type)(
        logprobs, old if needs_old else None, full, alg, loss_mask=m, rollout_logprobs=part.rollout_logprobs
    )
    if alg.use_kl_loss:
        ref = LocalPolicyWorker(cfg, model_path=str(ref_dir), role="ref")
        ref.build_model()
        loss = loss + alg.kl_loss_coef * kl_loss(logprobs, ref.logprobs(part), m, alg.kl_estimator_type)
    # SkyRL's worker: per micro-batch of consecutive rows, a token mean weighted by rows
    if alg.use_entropy_loss:
        entropy = torch.nn.functional.pad(-(log_p.exp() * log_p).sum(-1), (1, 0))
        size, n = cfg.trainer.micro_train_batch_size_per_gpu, len(m)
        mean = sum(len(m[i : i + size]) / n * masked_mean(entropy[i : i + size], m[i : i + size])
                   for i in range(0, n, size))
        loss = loss - alg.entropy_loss_coef * mean
        if record is not None:
            record["policy_entropy"] = float(mean.detach())
    loss.backward()
    return [p.grad.clone() for p in worker.model.parameters()]
