"""THE training step, shared by the synchronous and the fully-async trainer.

Groups of trajectories in, one (or a few) optimizer steps on a `PolicyWorker` out: group advantages
(GRPO / RLOO), zero-advantage groups dropped, a padded `RLBatch` with the rollout log-probabilities
and per-token weight versions, the off-policy correction when some tokens were sampled by older
weights than the trainer holds (proximal forward + truncated importance sampling), an optional KL
penalty to a frozen reference, then mini-batches and micro-batches with an exact token-mean (or
sequence-mean) gradient over each mini-batch. Micro-batches are cut from rows sorted by length and
padded only to their own longest row (`inflight.train.batch.plan_micro_batches`): the gradient does
not depend on the cut, and the long tail of a few rows no longer pads every other one.

Data parallel: every rank is handed the whole step and trains on its share of each mini-batch
(`inflight.train.data_parallel`); the averaged gradient is the one-rank gradient of the whole batch.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from inflight.config import Config
from inflight.config.implemented import require_implemented
from inflight.rollout.generator import TrajectoryGroup
from inflight.train.algorithms import (
    RLBatch,
    group_advantages,
    importance_stats,
    informative_groups,
    rl_loss,
    truncated_is_weights,
)
from inflight.train.data_parallel import (
    MicroPlan,
    Shard,
    StepStats,
    data_parallel,
    local_batch,
    micro_batches,
    shard_step,
)
from inflight.train.workers.base import PolicyWorker

IMPORTANCE_KEYS = ("is_ratio_mean", "is_ratio_max", "is_ratio_min", "is_weight_mean", "is_truncated_fraction")
LOSS_STAT_KEYS = ("loss", "clip_fraction", "ratio_mean", "ratio_max", "ratio_min", "kl", *IMPORTANCE_KEYS)
"""Statistics of the loss that are combined over the data-parallel ranks (the same on every rank)."""


@dataclass
class StepOptions:
    """The training step's settings. `from_config` reads them from the `trainer.*` keys each field
    names (their docs in inflight/config/schema.py); constructed directly, the defaults are the keys'."""

    tis: str = "token"
    """`token`, `sequence` or `none`: trainer.algorithm.off_policy_correction.tis_ratio_type (null: none)."""
    tis_cap: float = 2.0
    """off_policy_correction.token_tis_ratio_clip_high (sequence_tis_ratio_clip_high for `sequence`)."""
    drop_zero_advantage_groups: bool = True
    """trainer.algorithm.zero_variance_filter."""
    correct_threshold: float = 1.0
    """trainer.correct_threshold."""
    max_tokens_per_micro_batch: int | None = None
    """trainer.max_tokens_per_microbatch (None: no cap, the key's -1)."""
    micro_batch_pass_tokens: float = 64.0
    """trainer.micro_batch_pass_tokens (`math.inf`: the fewest passes the caps allow)."""

    @classmethod
    def from_config(cls, cfg: Config) -> StepOptions:
        """The options `cfg` sets. Raises ConfigError for keys set to what is not implemented yet."""
        require_implemented(cfg)
        trainer = cfg.trainer
        correction = trainer.algorithm.off_policy_correction
        tis = correction.tis_ratio_type or "none"
        cap = correction.sequence_tis_ratio_clip_high if tis == "sequence" else correction.token_tis_ratio_clip_high
        max_tokens = trainer.max_tokens_per_microbatch
        return cls(tis=tis, tis_cap=cap, drop_zero_advantage_groups=trainer.algorithm.zero_variance_filter,
                   correct_threshold=trainer.correct_threshold,
                   max_tokens_per_micro_batch=max_tokens if max_tokens > 0 else None,
                   micro_batch_pass_tokens=trainer.micro_batch_pass_tokens)


def build_batch(groups: Sequence[TrajectoryGroup], advantages: torch.Tensor, pad_id: int) -> RLBatch:
    """Right-padded [B, T] tensors of every trajectory in `groups` (row order: group by group).
    `advantages` [B] per trajectory. Rollout log-probabilities and versions sit at the position of
    the token they score (`logprobs[b, t]` scores token t), prompt positions have version -1."""
    trajs = [t for g in groups for t in g.trajectories]
    width = max(len(t.prompt_ids) + len(t.response_ids) for t in trajs)
    shape = (len(trajs), width)
    ids = torch.full(shape, pad_id, dtype=torch.long)
    attention = torch.zeros(shape, dtype=torch.long)
    mask = torch.zeros(shape, dtype=torch.float32)
    rollout = torch.zeros(shape, dtype=torch.float32)
    versions = torch.full(shape, -1, dtype=torch.long)
    for row, t in enumerate(trajs):
        p, r = len(t.prompt_ids), len(t.response_ids)
        ids[row, : p + r] = torch.tensor(t.prompt_ids + t.response_ids)
        attention[row, : p + r] = 1
        mask[row, p : p + r] = torch.tensor(t.loss_mask, dtype=torch.float32)
        rollout[row, p : p + r] = torch.tensor(t.logprobs, dtype=torch.float32)
        versions[row, p : p + r] = torch.tensor(t.versions)
    return RLBatch(input_ids=ids, loss_mask=mask, attention_mask=attention, advantages=advantages.float(),
                   old_logprobs=rollout, rollout_logprobs=rollout, versions=versions)


class TrainingStep:
    """Callable `(groups, policy_version) -> metrics` over one `PolicyWorker` (set up already).

    `policy_version`: the weight version the worker's weights are (the engines' version after the
    last sync); tokens sampled by an older version are stale. `options`: by default the ones `cfg`
    sets (`StepOptions.from_config`). `reference`: a frozen worker for the KL penalty
    (`trainer.algorithm.use_kl_loss`).
    """

    def __init__(self, worker: PolicyWorker, cfg: Config, pad_id: int, options: StepOptions | None = None,
                 reference: PolicyWorker | None = None) -> None:
        self.worker, self.cfg, self.pad_id = worker, cfg, pad_id
        self.options = options or StepOptions.from_config(cfg)
        self.reference = reference
        alg = cfg.trainer.algorithm
        self.kl_coef = alg.kl_loss_coef if alg.use_kl_loss else 0.0
        if self.kl_coef > 0 and reference is None:
            raise ValueError("trainer.algorithm.use_kl_loss needs a reference worker")
        self.loss_fn = rl_loss(alg.eps_clip_low, alg.eps_clip_high, alg.loss_reduction, self.kl_coef,
                               self.options.tis, self.options.tis_cap)
        worker.loss_fn = self.loss_fn
        self.dp = data_parallel(worker)
        self.first_pass_ratios: dict[str, float] = {}
        self.counts = {"trained_rows": 0, "passes": 0, "padded_tokens": 0, "real_tokens": 0}
        """This rank's rows with tokens trained on, forward/backward passes and the tokens they ran
        (with and without padding), over every step."""

    def __call__(self, groups: Sequence[TrajectoryGroup], policy_version: int) -> dict[str, float | None]:
        """Train on this rank's share of `groups` (every data-parallel rank gets all of them and
        trains on its own rows; see `inflight.train.data_parallel`); returns the step's metrics."""
        started, cpu_started = time.perf_counter(), time.thread_time()
        padded, real = self.counts["padded_tokens"], self.counts["real_tokens"]
        alg, opts = self.cfg.trainer.algorithm, self.options
        rewards = torch.tensor([g.rewards for g in groups], dtype=torch.float32)
        metrics = rollout_metrics(groups, policy_version, opts.correct_threshold)
        keep = informative_groups(rewards) if opts.drop_zero_advantage_groups else torch.ones(len(groups), dtype=torch.bool)
        metrics.update(groups_trained=float(keep.sum()), groups_dropped=float(len(groups) - keep.sum()))
        if not keep.any():  # nothing to learn from: no forward, no ratios, no optimizer step
            metrics.update(train_s=time.perf_counter() - started, train_cpu_s=time.thread_time() - cpu_started,
                           optimizer_steps=0.0, is_ratio_mean=None,
                           is_ratio_max=None, is_ratio_min=None)
            return metrics
        kept = [g for g, k in zip(groups, keep.tolist(), strict=True) if k]
        adv = group_advantages(rewards[keep], alg.advantage_estimator, alg.grpo_norm_by_std)
        batch = build_batch(kept, adv.reshape(-1), self.pad_id)
        plan = MicroPlan(self.cfg.trainer.micro_train_batch_size_per_gpu, opts.max_tokens_per_micro_batch,
                         opts.micro_batch_pass_tokens)
        shard = shard_step(len(kept), len(batch) // len(kept), self.groups_per_mini(len(kept)), plan, self.dp,
                           batch.widths().tolist())
        if alg.loss_reduction == "seq_mean_token_sum_norm":
            batch.token_sum_norm = mini_batch_longest(batch, shard)
        local = local_batch(batch, shard).to(self.worker.device)
        metrics.update(self._off_policy(batch, local, shard, policy_version, len(kept)))
        if self.kl_coef > 0:
            local.ref_logprobs = shard_logprobs(self.reference, local, shard)
        metrics.update(self._optimize(batch, local, shard))
        if "is_ratio_mean" not in metrics:
            # on-policy batch: the PPO ratio of the first mini-batch, taken before any update, IS the
            # trainer / rollout importance ratio (old = rollout log-probabilities); or TIS off
            ratios = self.first_pass_ratios
            metrics.update(is_ratio_mean=ratios.get("ratio_mean"), is_ratio_max=ratios.get("ratio_max"),
                           is_ratio_min=ratios.get("ratio_min"))
        metrics.update(train_s=time.perf_counter() - started, train_cpu_s=time.thread_time() - cpu_started,
                       trained_tokens=float(batch.loss_mask.sum()),
                       train_padded_tokens=float(self.counts["padded_tokens"] - padded),
                       train_real_tokens=float(self.counts["real_tokens"] - real))
        return metrics

    def groups_per_mini(self, num_groups: int) -> int:
        """Groups per optimizer step: `policy_mini_batch_size / train_batch_size` of the step's."""
        trainer = self.cfg.trainer
        return max(1, round(num_groups * trainer.policy_mini_batch_size / trainer.train_batch_size))

    def single_pass(self, num_groups: int) -> bool:
        """Whether the batch gets exactly one optimizer step (one mini-batch, one epoch): then every
        forward of the step runs on the weights the step starts from, the proximal policy."""
        return self.cfg.trainer.update_epochs_per_batch == 1 and self.groups_per_mini(num_groups) >= num_groups

    def _off_policy(self, batch: RLBatch, local: RLBatch, shard: Shard, policy_version: int,
                    num_groups: int) -> dict[str, float]:
        """Use the proximal policy and TIS weights when any token of the step (`batch`, on every
        rank alike) is older than the policy; this rank's rows (`local`) get them."""
        stale = bool(((batch.versions < policy_version) & (batch.loss_mask > 0)).any())
        out = {"off_policy": float(stale)}
        if not stale or self.options.tis == "none":
            return out
        if self.single_pass(num_groups):
            local.old_logprobs = None  # the training forward itself is the proximal policy (see rl_loss)
            return out
        t0 = time.perf_counter()
        prox, mask = shard_logprobs(self.worker, local, shard), local.loss_mask
        weights = truncated_is_weights(prox, local.rollout_logprobs, mask, self.options.tis, self.options.tis_cap)
        local.old_logprobs, local.is_weights = prox, weights
        stats = StepStats()
        stats.add(importance_stats(prox, local.rollout_logprobs, weights, mask, self.options.tis_cap),
                  float(mask.sum()) / max(float(batch.loss_mask.sum()), 1.0))
        stats = stats.reduced(self.dp, IMPORTANCE_KEYS)
        out.update(stats.sums | stats.extremes)
        out["prox_forward_s"] = time.perf_counter() - t0
        return out

    def _optimize(self, batch: RLBatch, local: RLBatch, shard: Shard) -> dict[str, float]:
        """One optimizer step per mini-batch, `update_epochs_per_batch` passes. Each rank runs the
        same number of micro-batches (padding with weight 0 where its share is smaller), each
        scaled by its share of the mini-batch's GLOBAL count times the data-parallel size: the
        backends average the ranks' gradients, which makes it the exact reduction over the mini-batch."""
        trainer = self.cfg.trainer
        per_token = trainer.algorithm.loss_reduction == "token_mean"
        stats, first_pass, count = StepStats(), None, 0
        self.worker.model.train()
        for _ in range(trainer.update_epochs_per_batch):
            for mini in shard.mini_batches:
                mask = batch.loss_mask[mini.rows]
                totals = max(_count(mask, per_token), 1.0), max(_count(mask, True), 1.0)
                for part, rows in micro_batches(local, mini):
                    self._pass(part, rows is not None, per_token, totals, stats)
                if first_pass is None:  # before any optimizer step: the policy that starts the step
                    first_pass = stats.copy()
                stats.add(self.worker.optimizer_step(), 1.0)
                count += 1
        self.worker.global_step += 1
        stats = stats.reduced(self.dp, LOSS_STAT_KEYS)
        first = first_pass.reduced(self.dp, LOSS_STAT_KEYS)
        self.first_pass_ratios = {"ratio_mean": first.sums.get("ratio_mean", 1.0),
                                  "ratio_max": first.extremes.get("ratio_max", 1.0),
                                  "ratio_min": first.extremes.get("ratio_min", 1.0)}
        metrics = {key: value / count for key, value in stats.sums.items()} | stats.extremes
        metrics["optimizer_steps"] = float(count)
        return metrics

    def _pass(self, part: RLBatch, real: bool, per_token: bool, totals: tuple[float, float],
              stats: StepStats) -> None:
        """One forward/backward of a micro-batch (`real`, or padding: weight 0). The loss counts by
        the micro-batch's share of what the reduction averages over (`totals[0]`, the mini-batch's),
        the loss statistics, token means, by its share of the mini-batch's tokens (`totals[1]`):
        both sums are then the mini-batch's, however its rows were cut and ordered."""
        share = _count(part.loss_mask, per_token) / totals[0] if real else 0.0
        out = self.worker.forward_backward(part, share * self.dp.size)
        self.counts["passes"] += 1
        self.counts["padded_tokens"] += part.input_ids.numel()
        if not real:
            return
        self.counts["trained_rows"] += int((part.loss_mask.sum(1) > 0).sum())
        self.counts["real_tokens"] += int(part.widths().sum())
        if share > 0:
            stats.add(out, share)
            stats.add(self.loss_fn.stats, _count(part.loss_mask, True) / totals[1])


def shard_logprobs(worker: PolicyWorker, local: RLBatch, shard: Shard) -> torch.Tensor:
    """[B, T] log-probabilities (no gradients) of the rank's rows `local`, forwarded in the
    micro-batches of the training passes (the same number on every rank: FSDP's forwards are
    collectives) and put back at each row's place; 0 beyond a row's micro-batch."""
    out = torch.zeros(local.loss_mask.shape, dtype=torch.float32, device=local.input_ids.device)
    for mini in shard.mini_batches:
        for part, rows in micro_batches(local, mini):
            logprobs = worker.logprobs(part)
            if rows is not None:
                out[rows, : logprobs.shape[1]] = logprobs.to(out)
    return out


def _count(mask: torch.Tensor, per_token: bool) -> float:
    """What the loss averages over: masked tokens, or sequences with any masked token."""
    return float(mask.sum()) if per_token else float((mask.sum(1) > 0).sum())


def mini_batch_longest(batch: RLBatch, shard: Shard) -> torch.Tensor:
    """[B] the longest masked length of each row's mini-batch (`seq_mean_token_sum_norm`'s divisor)."""
    lengths = batch.loss_mask.sum(1)
    norm = torch.zeros_like(lengths)
    for mini in shard.mini_batches:
        norm[mini.rows] = lengths[mini.rows].max()
    return norm


def rollout_metrics(groups: Sequence[TrajectoryGroup], policy_version: int, threshold: float = 1.0) -> dict[str, float]:
    """Reward, accuracy, lengths and staleness (in weight versions, from the per-token versions,
    relative to `policy_version`) of a step's groups."""
    trajs = [t for g in groups for t in g.trajectories]
    rewards = torch.tensor([float(t.reward) for t in trajs])
    lengths = torch.tensor([float(t.num_generated) for t in trajs])
    versions = torch.tensor([v for t in trajs for v in t.model_versions] or [policy_version], dtype=torch.float32)
    staleness = policy_version - versions
    per_traj = torch.tensor([policy_version - min(t.model_versions, default=policy_version) for t in trajs],
                            dtype=torch.float32)
    return {
        "reward": float(rewards.mean()),
        "accuracy": float((rewards >= threshold - 1e-9).float().mean()),
        "response_length": float(lengths.mean()),
        "groups": float(len(groups)),
        "samples": float(len(trajs)),
        "staleness_mean": float(staleness.mean()),
        "staleness_max": float(staleness.max()),
        "staleness_traj_max_mean": float(per_traj.mean()),
        "mixed_version_fraction": float(sum(len(set(t.model_versions)) > 1 for t in trajs) / len(trajs)),
        "recomputed_tokens": float(sum(t.num_recomputed_tokens for t in trajs)),
        "cached_tokens": float(sum(t.num_cached_tokens for t in trajs)),
        "generated_tokens": float(lengths.sum()),
        "truncated_fraction": float(sum(t.finish_reason == "length" for t in trajs) / len(trajs)),
        "reward/failures": float(sum(t.reward_failed for t in trajs)),
        "rollout/failed": float(sum(t.rollout_failed for t in trajs)),
    }
