"""Advantage estimators: token_level_rewards [B, T] (+ values for GAE) -> (advantages, returns), [B, T].

SkyRL 0.3.0's five (`trainer.algorithm.advantage_estimator`), operation for operation:

- `grpo`: outcome score s = sum_t r[t]; per group (x - mean) / (std + eps), std unbiased.
- `rloo`: per group (s - mean) * n / (n - 1) (= s minus the mean of the others).
- `maxrl`: per group (s - mean) / (mean + eps).
- `reinforce++`: discounted returns that restart after each masked position, whitened over the batch.
- `gae`: generalized advantage estimation over a critic's values, whitened over the batch.

Outcome estimators (grpo, rloo, maxrl) read `index` (group ids, `groups.py`) and sum the rewards over
all T positions (not only masked ones: SkyRL puts the reward on the last response token). They return
the same tensor as advantages and returns. All run without gradients; float32 in, float32 out.
"""

from __future__ import annotations

import torch

from inflight.algorithms.groups import GroupIds, group_rows
from inflight.algorithms.masked import masked_whiten


def _scores(token_level_rewards: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    if token_level_rewards.dim() != 2 or token_level_rewards.shape != response_mask.shape:
        raise ValueError(
            f"token_level_rewards {tuple(token_level_rewards.shape)} and response_mask "
            f"{tuple(response_mask.shape)} must both be [B, T]"
        )
    return token_level_rewards.sum(dim=-1)


@torch.no_grad()
def grpo_advantages(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: GroupIds,
    *,
    norm_by_std: bool = True,
    epsilon: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO (Shao et al. 2024, arXiv:2402.03300): A_i = (s_i - mean_g) / (std_g + epsilon), broadcast
    over the row's response tokens; `norm_by_std=False` (Dr. GRPO, arXiv:2503.20783): s_i - mean_g.

    std_g is the unbiased standard deviation of the group's scores. As in SkyRL, a group of one sample
    uses mean 0 and std 1, so its advantage is s / (1 + epsilon) (s without `norm_by_std`), not 0; a group
    whose scores are all equal gets 0. `epsilon` is SkyRL's 1e-6."""
    scores = _scores(token_level_rewards, response_mask)
    out = torch.empty_like(scores)
    for rows in group_rows(index, scores.shape[0], scores.device):
        vals = scores[rows]
        if len(rows) == 1:
            mean, std = torch.tensor(0.0), torch.tensor(1.0)
        else:
            mean, std = torch.mean(vals), torch.std(vals)
        out[rows] = (vals - mean) / (std + epsilon) if norm_by_std else vals - mean
    adv = out.unsqueeze(-1) * response_mask
    return adv, adv


@torch.no_grad()
def rloo_advantages(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: GroupIds
) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO (Ahmadian et al. 2024, arXiv:2402.14740): A_i = s_i - mean of the other n - 1 scores of its
    group = (s_i - mean_g) * n / (n - 1). A group of one sample gets 0 (SkyRL logs a warning there)."""
    scores = _scores(token_level_rewards, response_mask)
    out = torch.empty_like(scores)
    for rows in group_rows(index, scores.shape[0], scores.device):
        n = len(rows)
        vals = scores[rows]
        out[rows] = (vals - torch.mean(vals)) * (n / (n - 1)) if n > 1 else torch.zeros_like(vals)
    adv = out.unsqueeze(-1) * response_mask
    return adv, adv


@torch.no_grad()
def maxrl_advantages(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: GroupIds, *, epsilon: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor]:
    """MaxRL (SkyRL's `maxrl`): A_i = (s_i - mean_g) / (mean_g + epsilon), the group-relative reward
    normalised by the group's mean reward (a success rate for 0/1 rewards).

    As in SkyRL, a group of one sample gets A = s (its mean counts as 0, no division); a group whose
    mean is 0 gets 0 / epsilon = 0. A negative mean near -epsilon blows up: rewards are meant to be >= 0."""
    scores = _scores(token_level_rewards, response_mask)
    out = torch.empty_like(scores)
    for rows in group_rows(index, scores.shape[0], scores.device):
        vals = scores[rows]
        if len(rows) > 1:
            mean = torch.mean(vals)
            out[rows] = (vals - mean) / (mean + epsilon)
        else:
            out[rows] = vals - torch.tensor(0.0)
    adv = out.unsqueeze(-1) * response_mask
    return adv, adv


@torch.no_grad()
def reinforce_plus_plus_advantages(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, *, gamma: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (Hu 2025, arXiv:2501.03262): G[t] = r[t] + gamma * G[t+1], where the running return is
    reset to 0 after every position whose mask is 0 (so returns do not flow back across padding or
    masked observation tokens); advantages = masked_whiten(G, mask) * mask over the whole batch.

    Returns (advantages, G). Raises ValueError when the batch has fewer than 2 masked tokens (whitening
    needs a variance), as SkyRL does."""
    _scores(token_level_rewards, response_mask)
    returns = torch.zeros_like(token_level_rewards)
    running = 0
    for t in reversed(range(token_level_rewards.shape[1])):
        running = token_level_rewards[:, t] + gamma * running
        returns[:, t] = running
        running = running * response_mask[:, t]
    return masked_whiten(returns, response_mask) * response_mask, returns


@torch.no_grad()
def gae_advantages(
    token_level_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    gamma: float = 1.0,
    lambd: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE (Schulman et al. 2016, arXiv:1506.02438): delta[t] = r[t] + gamma * V[t+1] - V[t] (V[T] = 0),
    A[t] = delta[t] + gamma * lambd * A[t+1]; returns = A + V; advantages = masked_whiten(A, mask).

    As in SkyRL, the recursion runs over all T positions and ignores the mask: values and rewards past a
    row's last response token flow back into it. Pass values (and rewards) that are 0 outside the
    response to get textbook GAE for right-padded rows (what verl computes with its masked recursion).
    The whitened advantages are not re-masked. Raises ValueError with fewer than 2 masked tokens."""
    _scores(token_level_rewards, response_mask)
    if values is None or values.shape != token_level_rewards.shape:
        raise ValueError(
            f"gae needs the critic's values [B, T] shaped like the rewards {tuple(token_level_rewards.shape)}"
            f", got {None if values is None else tuple(values.shape)}"
        )
    last = 0
    reversed_adv = []
    length = token_level_rewards.shape[-1]
    for t in reversed(range(length)):
        next_values = values[:, t + 1] if t < length - 1 else 0.0
        delta = token_level_rewards[:, t] + gamma * next_values - values[:, t]
        last = delta + gamma * lambd * last
        reversed_adv.append(last)
    advantages = torch.stack(reversed_adv[::-1], dim=1)
    returns = advantages + values
    return masked_whiten(advantages, response_mask), returns


@torch.no_grad()
def batch_normalize_advantages(advantages: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """`trainer.algorithm.advantage_batch_normalize`: (A - mu) / sqrt(max(var, 1e-8)) over the batch.

    As SkyRL 0.3.0's trainer computes it: mu is the plain mean over all B*T positions (padding
    included), var = sum((A - mu)^2 * mask) / sum(mask) over the response tokens only, and padding
    positions are shifted too (the loss mask removes them later). Applied once per training batch,
    after the estimator and before the per-mini-batch `reductions.scale_advantages`.

    ValueError when the mask is empty (SkyRL would turn every advantage into NaN there)."""
    count = response_mask.sum()
    if count == 0:
        raise ValueError(
            "advantage_batch_normalize: the batch has no response token (response_mask is all 0)"
        )
    mean = advantages.mean()
    spread = ((advantages - mean).pow(2) * response_mask).sum()
    return (advantages - mean) * (spread / count).clamp(min=1e-8).rsqrt()
