"""THE training step, shared by the synchronous and the fully-async trainer.

Groups of trajectories in, the critic's and the policy's optimizer steps out, in SkyRL 0.3.0's order
(`inflight.train.objective` for the objective, `inflight.train.advantage_pipeline` for the batch-level
part): each trajectory's reward (DAPO's overlong penalty applied) on its last response token; the
zero-variance filter (rows of groups without signal keep their place but get an all-zero loss mask,
and no training pass runs on them); the forwards without gradients (the critic's values, the
reference's log-probabilities, the policy's old log-probabilities where the training forward cannot
be them); the KL in the reward or the distillation term; advantages and returns; the critic's
mini-batches; then the policy's, `update_epochs_per_batch` passes of one optimizer step per
mini-batch, each cut into micro-batches of rows sorted by length and padded only to their own
longest row (`inflight.train.batch.plan_micro_batches`). The gradient does not depend on the cut:
every loss term is a sum whose weights come from the whole mini-batch.

Data parallel: every rank is handed the whole step and trains on its share of each mini-batch
(`inflight.train.data_parallel`); what the batch-level part needs from the forwards (values, old and
reference log-probabilities) is gathered from every rank's rows, so every rank computes the same
advantages, and the averaged gradient is the one-rank gradient of the whole batch.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from inflight.algorithms import entropy_token_weights, episode_rows
from inflight.config import Config
from inflight.config.implemented import require_implemented
from inflight.rollout.task_generator import TrajectoryGroup
from inflight.train.advantage_pipeline import (
    ResponseLayout,
    compute_advantages,
    overlong_penalty,
    shaped_reward,
    token_rewards,
)
from inflight.train.batch import TrainBatch, image_rows
from inflight.train.critic import CriticBatch
from inflight.train.data_parallel import (
    MicroPlan,
    RowGroups,
    Shard,
    StepStats,
    data_parallel,
    forward_parts,
    gather_rows,
    local_batch,
    micro_batches,
    passes,
    shard_step,
)
from inflight.train.moe_metrics import logprob_gaps, routing_metrics
from inflight.train.objective import Objective, RLBatch, rl_loss, uses_reference
from inflight.train.routing_rows import routing_rows
from inflight.train.shared_prefix import context_lengths
from inflight.train.workers.base import PolicyWorker


@dataclass
class StepOptions:
    """The training step's micro-batching and reporting settings. `from_config` reads them from the
    `trainer.*` keys each field names; constructed directly, the defaults are the keys'. (What the step
    computes is `trainer.algorithm.*`, read by `inflight.train.objective.Objective`.)"""

    correct_threshold: float = 1.0
    """trainer.correct_threshold."""
    max_tokens_per_micro_batch: int | None = None
    """trainer.max_tokens_per_microbatch (None: no cap, the key's -1)."""
    micro_batch_pass_tokens: float = 64.0
    """trainer.micro_batch_pass_tokens (`math.inf`: the fewest passes the caps allow)."""
    shared_prefix_forward: bool = True
    """trainer.shared_prefix_forward: micro-batches of whole groups, each packed by the worker."""

    @classmethod
    def from_config(cls, cfg: Config) -> StepOptions:
        """The options `cfg` sets. Raises ConfigError for keys set to what is not implemented yet."""
        require_implemented(cfg)
        trainer = cfg.trainer
        max_tokens = trainer.max_tokens_per_microbatch
        return cls(correct_threshold=trainer.correct_threshold,
                   max_tokens_per_micro_batch=max_tokens if max_tokens > 0 else None,
                   micro_batch_pass_tokens=trainer.micro_batch_pass_tokens,
                   shared_prefix_forward=trainer.shared_prefix_forward)


def build_batch(groups: Sequence[TrajectoryGroup], advantages: torch.Tensor | None, pad_id: int) -> RLBatch:
    """Right-padded [B, T] tensors of every trajectory in `groups` (row order: group by group).
    `advantages` [B] or [B, T] (or None). Rollout log-probabilities and versions sit at the position
    of the token they score (`logprobs[b, t]` scores token t), prompt positions have version -1.
    A mixture-of-experts rollout's routing records become `routed_experts` (`routing_rows`), a
    vision-language rollout's images `pixel_values` / `image_grid_thw` (`image_rows`)."""
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
    adv = None if advantages is None else advantages.float()
    return RLBatch(input_ids=ids, loss_mask=mask, attention_mask=attention, advantages=adv,
                   rollout_logprobs=rollout, versions=versions, routed_experts=routing_rows(trajs, width),
                   **image_rows([t.images for t in trajs]))


class TrainingStep:
    """Callable `(groups, policy_version) -> metrics` over one `PolicyWorker` (set up already).

    `policy_version`: the weight version the worker's weights are (the engines' version after the
    last sync); tokens sampled by an older version are stale. `options`: by default the ones `cfg`
    sets (`StepOptions.from_config`). `reference`: a frozen worker (the KL terms, on-policy
    distillation's teacher); `critic`: a critic worker (`inflight.train.critic`, for `gae`).
    """

    def __init__(self, worker: PolicyWorker, cfg: Config, pad_id: int, options: StepOptions | None = None,
                 reference: PolicyWorker | None = None, critic: PolicyWorker | None = None) -> None:
        self.worker, self.cfg, self.pad_id = worker, cfg, pad_id
        self.options = options or StepOptions.from_config(cfg)
        self.objective = Objective.from_config(cfg)
        self.reference, self.critic = reference, critic
        if uses_reference(cfg) and reference is None:
            raise ValueError(
                "trainer.algorithm.use_kl_loss / use_kl_in_reward / on_policy_distillation need a "
                "reference worker"
            )
        if cfg.trainer.algorithm.advantage_estimator == "gae" and critic is None:
            raise ValueError("advantage_estimator=gae needs a critic worker (trainer.critic.model.path)")
        self.loss_fn = rl_loss(self.objective)
        worker.loss_fn = self.loss_fn
        self.dp = data_parallel(worker)
        self.ref_epoch = 0
        """The epoch whose start the reference holds the policy of (`update_ref_every_epoch`)."""
        self.counts = {"trained_rows": 0, "passes": 0, "padded_tokens": 0, "real_tokens": 0}
        """This rank's rows with tokens trained on, forward/backward passes, the tokens they ran
        (padding included; packed rows under `shared_prefix_forward`, fewer than the rows' own) and the
        rows' own tokens, over every step."""

    # ---- the step -------------------------------------------------------------------------------
    def __call__(self, groups: Sequence[TrajectoryGroup], policy_version: int) -> dict[str, float | None]:
        """Train on this rank's share of `groups` (every data-parallel rank gets all of them and
        trains on its own rows; see `inflight.train.data_parallel`); returns the step's metrics."""
        started, cpu_started = time.perf_counter(), time.thread_time()
        padded, real = self.counts["padded_tokens"], self.counts["real_tokens"]
        metrics: dict[str, Any] = rollout_metrics(groups, policy_version, self.options.correct_threshold)
        metrics.update(self._update_reference(groups))
        episodes = None
        if self.cfg.generator.step_wise_trajectories and not self.cfg.generator.merge_stepwise_output:
            groups, episodes = step_rows(groups)
        trajs, uids = rows_of_groups(groups, equal=episodes is None)
        batch = build_batch(groups, None, self.pad_id)
        penalties = self._penalties(trajs)
        shaped = [shaped_reward(t, p) for t, p in zip(trajs, penalties, strict=True)]
        # an episode's outcome is its last turn's reward (SkyRL's step-wise estimate)
        if episodes is not None:
            last, owner = episode_rows(episodes)
            shaped = [shaped[last[e]] for e in owner]
            metrics["step_wise_rows"] = float(len(trajs))
        live = self._zero_variance_filter(batch, shaped, uids, metrics)
        if any(live):
            metrics["off_policy"] = float(
                bool(((batch.versions < policy_version) & (batch.loss_mask > 0)).any())
            )
            metrics.update(
                self._train(groups, batch, live, ResponseLayout.of(trajs), penalties, uids, metrics, episodes)
            )
            metrics.update(trained_tokens=float(batch.loss_mask.sum()),
                           train_padded_tokens=float(self.counts["padded_tokens"] - padded),
                           train_real_tokens=float(self.counts["real_tokens"] - real))
        else:  # nothing to learn from: no forward, no ratios, no optimizer step
            metrics.update(optimizer_steps=0.0, is_ratio_mean=None, is_ratio_max=None, is_ratio_min=None)
        metrics.update(train_s=time.perf_counter() - started, train_cpu_s=time.thread_time() - cpu_started)
        return metrics

    def _train(
        self,
        groups: Sequence[TrajectoryGroup],
        batch: RLBatch,
        live: list[bool],
        layout: ResponseLayout,
        penalties: list[float | None],
        uids: list[int],
        metrics: dict[str, Any],
        episodes: list[int] | None = None,
    ) -> dict[str, float]:
        """The forwards, the advantages, the critic's and the policy's optimizer steps of a batch with
        something to learn from; their metrics. `episodes`: each row's episode (step-wise rows)."""
        size, widths = [len(g.trajectories) for g in groups], batch.widths().tolist()
        shared = self.shared_rows(batch, uids)
        shard = shard_step(
            len(groups), size, self.groups_per_mini(len(groups)), self.plan(shared), self.dp, widths, live
        )
        batch.row_weight, batch.token_weight = mini_batch_weights(batch.loss_mask, shard,
                                                                  self.cfg.trainer.micro_train_batch_size_per_gpu)
        local = local_batch(batch, shard).to(self.worker.device)
        old = self._old_logprobs(batch, local, shard, live, len(groups), metrics, shared)
        ref = self._reference_logprobs(batch, local, shard, live, shared)
        critic_shard = self._critic_shard(len(groups), size, widths, live)
        values = self._values(batch, critic_shard, layout)
        take = lambda full: None if full is None else layout.take(full)  # noqa: E731
        adv = compute_advantages(
            self.objective,
            token_rewards([t for g in groups for t in g.trajectories], layout, penalties),
            layout,
            layout.take(batch.loss_mask),
            uids,
            [(m.rows.start, m.rows.stop) for m in shard.mini_batches],
            self.cfg.trainer.micro_train_batch_size_per_gpu,
            values=take(values),
            old_logprobs=take(old),
            ref_logprobs=take(ref),
            left_out=[t.rollout_failed for g in groups for t in g.trajectories],
            episodes=episodes,
        )
        out = dict(adv.metrics)
        width = batch.input_ids.shape[1]
        batch.advantages = layout.put(adv.scaled, width)
        local.advantages = rows_of(batch.advantages, shard, local).to(self.worker.device)
        out.update(logprob_gaps(self, batch, local, shard, live))  # on the weights the step starts from
        if self.critic is not None:
            out.update(self._train_critic(batch, values, layout.put(adv.returns, width), critic_shard))
        out.update(self._optimize(batch, local, shard))
        out.update(routing_metrics(self))  # what the training forwards' router hooks counted
        return out

    # ---- settings ---------------------------------------------------------------------------------
    def groups_per_mini(self, num_groups: int, mini_batch_size: int | None = None) -> int:
        """Groups per optimizer step: `policy_mini_batch_size / train_batch_size` of the step's
        (`mini_batch_size`: another one's, the critic's)."""
        trainer = self.cfg.trainer
        size = trainer.policy_mini_batch_size if mini_batch_size is None else mini_batch_size
        return max(1, round(num_groups * size / trainer.train_batch_size))

    def single_pass(self, num_groups: int) -> bool:
        """Whether the batch gets exactly one optimizer step (one mini-batch, one epoch): then every
        forward of the step runs on the weights the step starts from, the old policy."""
        return (
            self.cfg.trainer.update_epochs_per_batch == 1 and self.groups_per_mini(num_groups) >= num_groups
        )

    def plan(self, shared: RowGroups | None = None) -> MicroPlan:
        """The training passes' micro-batches (`micro_train_batch_size_per_gpu`, token cap, pass cost;
        `shared`: by group, `shared_rows`)."""
        return MicroPlan(
            self.cfg.trainer.micro_train_batch_size_per_gpu,
            self.options.max_tokens_per_micro_batch,
            self.options.micro_batch_pass_tokens,
            shared,
        )

    def forward_plan(self, shared: RowGroups | None = None) -> MicroPlan:
        """Forward-only passes' micro-batches (`micro_forward_batch_size_per_gpu`)."""
        return MicroPlan(
            self.cfg.trainer.micro_forward_batch_size_per_gpu,
            self.options.max_tokens_per_micro_batch,
            self.options.micro_batch_pass_tokens,
            shared,
        )

    def shared_rows(self, batch: RLBatch, uids: list[int]) -> RowGroups | None:
        """With `shared_prefix_forward`, the step's rows by shared context (the rows of a group, `uids`,
        whose contexts are equal: every row of a prompt, but step-wise rows only with the same
        earlier turns) and the length of each row's context (`shared_prefix.context_lengths`); else None."""
        if not self.options.shared_prefix_forward:
            return None
        contexts = context_lengths(batch.loss_mask, batch.widths())
        keys: dict[tuple[int, tuple[int, ...]], int] = {}
        rows = [keys.setdefault((uid, tuple(batch.input_ids[row, :n].tolist())), len(keys))
                for row, (uid, n) in enumerate(zip(uids, contexts, strict=True))]
        return RowGroups(tuple(rows), tuple(contexts))

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps of the step (the KL controller, the reference's epoch)."""
        return {**self.objective.state(), "ref_epoch": self.ref_epoch}

    def load_state(self, state: dict[str, Any]) -> None:
        self.objective.load_state(state)
        self.ref_epoch = int(state.get("ref_epoch", 0))

    # ---- before the forwards -----------------------------------------------------------------------
    def _penalties(self, trajs: Sequence[Any]) -> list[float | None]:
        """Each trajectory's overlong penalty (`overlong_buffer_len`; None: its reward becomes 0)."""
        alg = self.cfg.trainer.algorithm
        longest = self.cfg.generator.sampling_params.max_generate_length
        return [overlong_penalty(len(t.response_ids), longest, alg.overlong_buffer_len,
                                 alg.overlong_buffer_penalty_factor) for t in trajs]

    def _zero_variance_filter(self, batch: RLBatch, rewards: list[float], uids: list[int],
                              metrics: dict[str, Any]) -> list[bool]:
        """`zero_variance_filter`: rows of groups whose rewards are equal within the tolerance get an
        all-zero loss mask (SkyRL's); returns which rows still have tokens to train on."""
        from inflight.algorithms import zero_variance_filter

        alg = self.cfg.trainer.algorithm
        if alg.zero_variance_filter:
            kept = set(zero_variance_filter(rewards, uids, batch.loss_mask, alg.zero_variance_filter_tol))
            dropped = [row for row in range(len(uids)) if row not in kept]
            batch.loss_mask[dropped] = 0.0
        groups = len(set(uids))
        trained = len({uid for uid, m in zip(uids, batch.loss_mask.sum(1).tolist(), strict=True) if m > 0})
        metrics.update(groups_trained=float(trained), groups_dropped=float(groups - trained))
        return (batch.loss_mask.sum(1) > 0).tolist()

    def _update_reference(self, groups: Sequence[TrajectoryGroup]) -> dict[str, float]:
        """`update_ref_every_epoch`: once every group of a step is of a later epoch than the one the
        reference holds, the policy's weights go into it (the epoch before is trained out)."""
        if not self.cfg.trainer.update_ref_every_epoch or self.reference is None:
            return {}
        epoch = min(g.epoch for g in groups)
        if epoch <= self.ref_epoch:
            return {}
        self.reference.load_hf_state(self.worker.iter_full_hf_tensors())
        self.ref_epoch = epoch
        return {"ref_updated": 1.0}

    # ---- forwards without gradients ----------------------------------------------------------------
    def _old_logprobs(self, batch: RLBatch, local: RLBatch, shard: Shard, live: list[bool], num_groups: int,
                      metrics: dict[str, Any], shared: RowGroups | None = None) -> torch.Tensor | None:
        """The old log-probabilities: none when nothing reads them or the training forward is them
        (one optimizer step: `local.old_logprobs` stays None), else a forward, in the training
        micro-batches (`recompute_old_logprobs_per_minibatch`) or in forward micro-batches. Returns
        every rank's rows of them ([B, T]) when the rewards need them, else None."""
        objective = self.objective
        if not objective.needs_old_logprobs or (self.single_pass(num_groups)
                                                and not objective.old_logprobs_before_training):
            return None
        t0 = time.perf_counter()
        if self.cfg.trainer.recompute_old_logprobs_per_minibatch:
            local.old_logprobs = shard_logprobs(self.worker, local, shard)
        else:
            parts, count = forward_parts(shard, self.forward_plan(shared), batch.widths().tolist(), live)
            local.old_logprobs = forward_rows(self.worker.logprobs, local, parts, count)
        metrics["prox_forward_s"] = time.perf_counter() - t0
        if not objective.old_logprobs_before_training:
            return None
        return gather_rows(local.old_logprobs.cpu(), shard, len(batch), self.dp)

    def _reference_logprobs(self, batch: RLBatch, local: RLBatch, shard: Shard, live: list[bool],
                            shared: RowGroups | None = None) -> torch.Tensor | None:
        """The reference's log-probabilities of this rank's rows (`local.ref_logprobs`), in forward
        micro-batches; every rank's rows ([B, T]) when the rewards need them, else None."""
        if self.reference is None:
            return None
        parts, count = forward_parts(shard, self.forward_plan(shared), batch.widths().tolist(), live)
        local.ref_logprobs = forward_rows(self.reference.logprobs, local, parts, count).to(self.worker.device)
        if not self.objective.old_logprobs_before_training:
            return None
        return gather_rows(local.ref_logprobs.cpu(), shard, len(batch), self.dp)

    def _critic_shard(
        self, num_groups: int, group_size: list[int], widths: list[int], live: list[bool]
    ) -> Shard | None:
        if self.critic is None:
            return None
        per_mini = self.groups_per_mini(num_groups, self.cfg.trainer.critic_mini_batch_size)
        return shard_step(num_groups, group_size, per_mini, self.plan(), self.dp, widths, live)

    def _values(self, batch: RLBatch, shard: Shard | None, layout: ResponseLayout) -> torch.Tensor | None:
        """The critic's values of every row ([B, T], 0 outside the responses: GAE's recursion then
        stops at each row's end), in forward micro-batches over every rank's rows."""
        if shard is None:
            return None
        local = local_batch(batch, shard)
        parts, count = forward_parts(shard, self.forward_plan(), batch.widths().tolist())
        values = gather_rows(
            forward_rows(self.critic.values, local, parts, count).cpu(), shard, len(batch), self.dp
        )
        return values * layout.put(layout.mask(), values.shape[1])

    # ---- training ---------------------------------------------------------------------------------------
    def _train_critic(
        self, batch: RLBatch, values: torch.Tensor, returns: torch.Tensor, shard: Shard
    ) -> dict[str, float]:
        """The critic's optimizer steps, one per critic mini-batch (`critic_mini_batch_size` prompts),
        `update_epochs_per_batch` passes; each micro-batch's value loss weighted by its share of the
        mini-batch's rows (SkyRL's loss is a mean over rows)."""
        critic, dp = self.critic, self.dp
        data = CriticBatch(
            input_ids=batch.input_ids,
            loss_mask=batch.loss_mask,
            attention_mask=batch.attention_mask,
            old_values=values,
            returns=returns,
        )
        local = local_batch(data, shard).to(critic.device)
        stats, local_stats, count = StepStats(), StepStats(), 0
        critic.model.train()
        for _ in range(self.cfg.trainer.update_epochs_per_batch):
            for mini in shard.mini_batches:
                rows = mini.rows.stop - mini.rows.start
                for part, idx in micro_batches(local, mini):
                    share = len(part) / rows if idx is not None else 0.0
                    out = critic.forward_backward(part, share * dp.size)
                    if idx is not None:
                        stats.add(out, share)
                local_stats.add(critic.optimizer_step(), 1.0)
                count += 1
        critic.global_step += 1
        reduced = stats.reduced(dp)
        out = {k: v / count for k, v in (reduced.sums | local_stats.sums).items()} | reduced.extremes
        return {f"critic/{k}": v for k, v in out.items()}

    def _optimize(self, batch: RLBatch, local: RLBatch, shard: Shard) -> dict[str, float]:
        """One optimizer step per mini-batch, `update_epochs_per_batch` passes. Each rank runs the
        same number of micro-batches (padding with weight 0 where its share is smaller); every loss
        term's weights are its share of the whole mini-batch, and the loss is multiplied by the
        data-parallel size: the backends average the ranks' gradients, which makes it the exact
        gradient of the mini-batch."""
        stats, local_stats, count = StepStats(), StepStats(), 0
        self.worker.model.train()
        for _ in range(self.cfg.trainer.update_epochs_per_batch):
            for mini in shard.mini_batches:
                tokens = max(float(batch.loss_mask[mini.rows].sum()), 1.0)
                for part, rows in micro_batches(local, mini):
                    self._pass(part, rows is not None, tokens, stats)
                local_stats.add(self.worker.optimizer_step(), 1.0)
                count += 1
        self.worker.global_step += 1
        reduced = stats.reduced(self.dp)
        metrics = {
            key: value / count for key, value in (reduced.sums | local_stats.sums).items()
        } | reduced.extremes
        metrics["optimizer_steps"] = float(count)
        return metrics

    def _pass(self, part: RLBatch, real: bool, tokens: float, stats: StepStats) -> None:
        """One forward/backward of a micro-batch (`real`, or padding: weight 0). The loss statistics,
        token means, count by the micro-batch's share of the mini-batch's tokens; the loss, a sum,
        as it is."""
        out = self.worker.forward_backward(part, float(self.dp.size) if real else 0.0)
        self.counts["passes"] += 1
        ran = self.worker.forward_tokens
        self.counts["padded_tokens"] += part.input_ids.numel() if ran is None else ran
        if not real:
            return
        self.counts["trained_rows"] += int((part.loss_mask.sum(1) > 0).sum())
        self.counts["real_tokens"] += int(part.widths().sum())
        stats.add({**out, **self.loss_fn.sums}, 1.0)
        stats.add(self.loss_fn.stats, float(part.loss_mask.sum()) / tokens)


def rows_of_groups(groups: Sequence[TrajectoryGroup], equal: bool = True) -> tuple[list[Any], list[int]]:
    """The step's trajectories, group by group, and each one's group (SkyRL's `index`). With `equal`,
    groups must be of one size (each prompt's `n` episodes; step-wise rows are not)."""
    sizes = {len(g.trajectories) for g in groups}
    if equal and len(sizes) != 1:
        raise ValueError(
            f"every group of a step must have the same number of trajectories (got {sorted(sizes)})"
        )
    return [t for g in groups for t in g.trajectories], [
        i for i, g in enumerate(groups) for _ in g.trajectories
    ]


def step_rows(groups: Sequence[TrajectoryGroup]) -> tuple[list[TrajectoryGroup], list[int]]:
    """`generator.step_wise_trajectories`: each group with one row per turn of each of its episodes
    (`Trajectory.steps`), an episode's turns in order, and each row's episode (numbered over the step)."""
    out: list[TrajectoryGroup] = []
    episodes: list[int] = []
    for group in groups:
        rows = []
        for t in group.trajectories:
            steps = t.steps()
            episodes += [episodes[-1] + 1 if episodes else 0] * len(steps)
            rows += steps
        out.append(replace(group, trajectories=rows))
    return out, episodes


def mini_batch_weights(loss_mask: torch.Tensor, shard: Shard,
                       micro_batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[B] 1 / rows of each row's mini-batch (the KL loss's weight: a mean over its rows) and [B] each
    row's entropy weight (`entropy_token_weights`: SkyRL's mean over the mini-batch's micro-batches of
    `micro_batch_size` consecutive rows of their token means), whatever micro-batches the step runs."""
    rows = torch.zeros(loss_mask.shape[0])
    for mini in shard.mini_batches:
        rows[mini.rows] = 1.0 / (mini.rows.stop - mini.rows.start)
    bounds = [(mini.rows.start, mini.rows.stop) for mini in shard.mini_batches]
    return rows, entropy_token_weights(loss_mask.float(), bounds, micro_batch_size)


def rows_of(full: torch.Tensor, shard: Shard, local: TrainBatch) -> torch.Tensor:
    """This rank's rows of a [B, ...] step tensor, as `local_batch` holds them (zeros for the one
    padding row of a rank without rows)."""
    if not shard.rows:
        return torch.zeros_like(local.loss_mask)
    return full[torch.tensor(shard.rows, dtype=torch.long)]


def forward_rows(fn: Callable[[TrainBatch], torch.Tensor], local: TrainBatch, parts: Sequence[Sequence[int]],
                 count: int) -> torch.Tensor:
    """[rows, T] of `fn` (a forward without gradients: log-probabilities, values) on the rank's rows
    `local`, run in the micro-batches `parts` and padding up to `count` passes (the same number on
    every rank: FSDP's forwards are collectives) and put back at each row's place; 0 elsewhere."""
    out = torch.zeros(local.loss_mask.shape, dtype=torch.float32, device=local.input_ids.device)
    for part, rows in passes(local, parts, count):
        got = fn(part)
        if rows is not None:
            out[rows, : got.shape[1]] = got.to(out)
    return out


def shard_logprobs(worker: PolicyWorker, local: RLBatch, shard: Shard) -> torch.Tensor:
    """[B, T] log-probabilities (no gradients) of the rank's rows `local`, forwarded in the
    micro-batches of the training passes and put back at each row's place; 0 beyond a row's
    micro-batch (rows without tokens to train on are in none)."""
    out = torch.zeros(local.loss_mask.shape, dtype=torch.float32, device=local.input_ids.device)
    for mini in shard.mini_batches:
        out += forward_rows(worker.logprobs, local, mini.parts, mini.micro_batches)
    return out


def rollout_metrics(
    groups: Sequence[TrajectoryGroup], policy_version: int, threshold: float = 1.0
) -> dict[str, float]:
    """Reward, accuracy, lengths and staleness (in weight versions, from the per-token versions,
    relative to `policy_version`) of a step's groups."""
    trajs = [t for g in groups for t in g.trajectories]
    rewards = torch.tensor([float(t.reward) for t in trajs])
    lengths = torch.tensor([float(t.num_generated) for t in trajs])
    versions = torch.tensor(
        [v for t in trajs for v in t.model_versions] or [policy_version], dtype=torch.float32
    )
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
        "rollout/failed_tokens_masked": float(sum(t.num_sampled for t in trajs if t.rollout_failed)),
    }


__all__ = [
    "StepOptions",
    "TrainingStep",
    "build_batch",
    "forward_rows",
    "rollout_metrics",
    "shard_logprobs",
    "step_rows",
]
