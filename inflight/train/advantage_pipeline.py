"""From a step's trajectories to per-token advantages, SkyRL 0.3.0's way: token-level rewards, the KL
in the reward (or on-policy distillation's teacher term), the advantage estimator, batch
normalisation, and the per-mini-batch scaling of each `loss_reduction`.

The whole batch is computed on every data-parallel rank alike, in SkyRL's response layout: [B, R]
tensors whose column j is response token j of the row (R the batch's longest response), so the
estimators and `advantage_batch_normalize` (whose mean counts the layout's padding, as SkyRL's)
see exactly what SkyRL's see. `ResponseLayout` moves tensors between it and the step's [B, T]
layout (prompt + response, aligned with `input_ids`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from inflight.algorithms import (
    batch_normalize_advantages,
    episode_rows,
    kl_penalized_rewards,
    prompt_boundaries,
    scale_minibatch_advantages,
)
from inflight.rollout.trajectory import Trajectory
from inflight.train.objective import Objective


@dataclass(frozen=True)
class ResponseLayout:
    """Where each row's response sits in the [B, T] layout: it starts at `starts[b]` (the prompt's
    length) and has `lengths[b]` tokens."""

    starts: torch.Tensor
    lengths: torch.Tensor

    @classmethod
    def of(cls, trajectories: Sequence[Trajectory]) -> ResponseLayout:
        return cls(torch.tensor([len(t.prompt_ids) for t in trajectories]),
                   torch.tensor([len(t.response_ids) for t in trajectories]))

    @property
    def width(self) -> int:
        return int(self.lengths.max()) if len(self.lengths) else 0

    def mask(self) -> torch.Tensor:
        """[B, R] SkyRL's `response_mask`: 1 on every response token (sampled or the environment's)."""
        return (torch.arange(self.width)[None] < self.lengths[:, None]).float()

    def _index(self, width: int) -> torch.Tensor:
        return (self.starts[:, None] + torch.arange(self.width)[None]).clamp(max=width - 1)

    def take(self, full: torch.Tensor) -> torch.Tensor:
        """[B, T] -> [B, R] (0 past each response)."""
        return full.gather(1, self._index(full.shape[1]).to(full.device)) * self.mask().to(full)

    def put(self, response: torch.Tensor, width: int) -> torch.Tensor:
        """[B, R] -> [B, T] of `width` columns (0 outside each response)."""
        out = torch.zeros((response.shape[0], width), dtype=response.dtype)
        masked = response.cpu() * self.mask().to(response.dtype)
        return out.scatter_add_(1, self._index(width), masked)


def overlong_penalty(
    response_length: int, max_length: int, buffer: int | None, factor: float
) -> float | None:
    """DAPO's soft overlong punishment (`overlong_buffer_len`, `overlong_buffer_penalty_factor`, the keys
    of SkyRL's DAPO example): what a response of `response_length` tokens loses from its reward,
    (length - (max_length - buffer)) / buffer * factor past `max_length - buffer` (0 before, and
    without a buffer), or None when it is longer than `max_length` (its reward becomes 0)."""
    if buffer is None:
        return 0.0
    if buffer > max_length:
        raise ValueError(f"trainer.algorithm.overlong_buffer_len={buffer} exceeds the longest response "
                         f"(generator.sampling_params.max_generate_length={max_length})")
    if response_length > max_length:
        return None
    start = max_length - buffer
    return (response_length - start) / buffer * factor if response_length > start else 0.0


def shaped_reward(trajectory: Trajectory, penalty: float | None) -> float:
    """The trajectory's reward after the overlong penalty (what the zero-variance filter and the
    metrics of the shaped reward read)."""
    return 0.0 if penalty is None else float(trajectory.reward) - penalty


def token_rewards(trajectories: Sequence[Trajectory], layout: ResponseLayout,
                  penalties: Sequence[float | None]) -> torch.Tensor:
    """[B, R] token-level rewards: each turn's reward on the last token the model sampled in that
    turn (`Trajectory.turn_rewards`; without them the whole reward on the last response token, as
    SkyRL places response-level rewards), the overlong penalty taken from the last response token
    (an overlong response's rewards all 0, as SkyRL's DAPO shaping does for token-level rewards)."""
    out = torch.zeros((len(trajectories), layout.width))
    for row, (t, penalty) in enumerate(zip(trajectories, penalties, strict=True)):
        if not t.response_ids or penalty is None:
            continue
        last = len(t.response_ids) - 1
        for position, reward in t.turn_rewards or [(last, float(t.reward))]:
            if position >= 0:
                out[row, position] += reward
        out[row, last] -= penalty
    return out


@dataclass
class Advantages:
    """A step's advantages ([B, R], before and after the reduction's scaling), returns [B, R], and the
    metrics of the rewards that made them."""

    raw: torch.Tensor
    scaled: torch.Tensor
    returns: torch.Tensor
    metrics: dict[str, float]


def compute_advantages(objective: Objective, rewards: torch.Tensor, layout: ResponseLayout,
                       loss_mask: torch.Tensor, uids: Sequence[int], mini_batches: Sequence[tuple[int, int]],
                       micro_batch_size: int, values: torch.Tensor | None = None,
                       old_logprobs: torch.Tensor | None = None,
                       ref_logprobs: torch.Tensor | None = None,
                       left_out: Sequence[bool] | None = None,
                       episodes: Sequence[int] | None = None) -> Advantages:
    """SkyRL's steps 4-7 on one batch in the response layout (`loss_mask`, `values`, `old_logprobs`,
    `ref_logprobs` [B, R]): on-policy distillation's teacher term in place of the rewards, or the KL
    in the reward (its controller updated), the estimator, `advantage_batch_normalize`, then each
    (start, end) mini-batch's scaling for `loss_reduction`.

    `left_out` (per row): rows that are no outcome (episodes whose harness failed,
    `Trajectory.rollout_failed`): steps 4-6 run on the other rows alone, as if the left-out rows
    were not in the batch (a group's mean and std are its finished episodes'), and the left-out rows
    get advantage and return 0 (their loss mask is 0 too).

    `episodes` (per row; `generator.step_wise_trajectories`, one row per turn): each row's episode,
    an episode's rows consecutive, its last turn last. SkyRL's step-wise estimate: the estimator runs
    on each episode's last row alone, its rewards as they are (earlier turns' rewards do not count)
    under an all-ones response mask, and that row's advantage and return (an outcome estimator's
    one number) go to every response token of every row of its episode."""
    kept = [not x for x in left_out] if left_out is not None else [True] * len(uids)
    rows = torch.tensor(kept, dtype=torch.bool).nonzero().squeeze(1)
    width = int(layout.lengths[rows].max()) if len(rows) else 0  # the kept rows' layout
    pick = lambda x: None if x is None else x[rows, :width]  # noqa: E731
    response_mask = pick(layout.mask())
    raw, returns, metrics = _estimate(
        objective,
        pick(rewards),
        response_mask,
        pick(loss_mask),
        [uids[i] for i in rows.tolist()],
        pick(values),
        pick(old_logprobs),
        pick(ref_logprobs),
        None if episodes is None else [episodes[i] for i in rows.tolist()],
    )
    alg = objective.config
    normalised = batch_normalize_advantages(raw, response_mask) if alg.advantage_batch_normalize else raw
    raw_full, adv, returns_full = (torch.zeros_like(rewards) for _ in range(3))
    raw_full[rows, :width], adv[rows, :width], returns_full[rows, :width] = raw, normalised, returns
    scaled = scale_minibatch_advantages(adv, loss_mask, alg.loss_reduction, list(mini_batches),
                                        micro_batch_size=micro_batch_size, max_seq_len=alg.max_seq_len,
                                        prompt_boundaries=prompt_boundaries(list(uids)))
    return Advantages(raw_full, scaled, returns_full, metrics)


def _estimate(
    objective: Objective,
    rewards: torch.Tensor,
    response_mask: torch.Tensor,
    loss_mask: torch.Tensor,
    uids: list[int],
    values: torch.Tensor | None,
    old_logprobs: torch.Tensor | None,
    ref_logprobs: torch.Tensor | None,
    episodes: Sequence[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """Steps 4-5 on the rows given: (advantages, returns, metrics) before batch normalisation
    (`episodes`: step-wise, see `compute_advantages`)."""
    alg = objective.config
    metrics: dict[str, float] = {}
    if alg.on_policy_distillation:  # SkyRL's example: reward = -(log pi - log pi_teacher) per token
        rewards = -(old_logprobs - ref_logprobs) * loss_mask
        metrics["distill/reverse_kl"] = float(
            ((old_logprobs - ref_logprobs) * loss_mask).sum() / loss_mask.sum().clamp(min=1)
        )
    elif alg.use_kl_in_reward:
        coef = objective.kl_controller.value
        rewards, kl = kl_penalized_rewards(
            rewards, old_logprobs, ref_logprobs, loss_mask, coef, alg.kl_estimator_type
        )
        objective.kl_controller.update(float(kl["avg_kl"]), rewards.shape[0])
        metrics.update(
            {"avg_kl": float(kl["avg_kl"]), "avg_kl_max": float(kl["avg_kl_max"]), "kl_loss_coef": coef}
        )
    last, owner = episode_rows(episodes) if episodes is not None else (list(range(len(uids))), None)
    ones = torch.ones_like(response_mask[last]) if owner is not None else response_mask
    adv, returns = objective.estimator(
        token_level_rewards=rewards[last],
        response_mask=ones,
        index=[uids[i] for i in last],
        values=None if values is None else values[last],
        gamma=alg.gamma,
        lambd=alg.lambd,
        grpo_norm_by_std=alg.grpo_norm_by_std,
        config=alg,
    )
    if owner is not None:  # each episode's last row's numbers on every row of the episode
        adv, returns = adv[owner] * response_mask, returns[owner] * response_mask
    live = response_mask.bool()
    metrics.update(avg_final_rewards=float(rewards[last].sum(-1).mean()),
                   avg_raw_advantages=float(adv[live].mean()) if live.any() else 0.0)
    return adv, returns, metrics
