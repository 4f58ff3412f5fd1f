"""Random batches for tests/algorithms: [B, T] float32 tensors with masks that have empty rows, holes
(masked observation tokens) and full rows, and group ids with one-sample and all-equal groups."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch

TOL = {"rtol": 1e-6, "atol": 1e-6}
SEEDS = (0, 1, 2)


@dataclass
class Batch:
    log_probs: torch.Tensor
    old_log_probs: torch.Tensor
    rollout_logprobs: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor
    rewards: torch.Tensor
    values: torch.Tensor
    uids: list[str]


def random_mask(gen: torch.Generator, rows: int, length: int, holes: bool = True) -> torch.Tensor:
    """Right-padded rows of random length; row 0 empty, row 1 full; `holes` zeroes ~15% inside rows."""
    lengths = torch.randint(1, length + 1, (rows,), generator=gen)
    lengths[0], lengths[1] = 0, length
    mask = (torch.arange(length)[None, :] < lengths[:, None]).float()
    if holes:
        mask = mask * (torch.rand(rows, length, generator=gen) > 0.15).float()
        mask[1] = 1.0
    return mask


def group_uids(sizes: tuple[int, ...]) -> list[str]:
    """Contiguous uids: `sizes[k]` rows of prompt pk."""
    return [f"p{k}" for k, n in enumerate(sizes) for _ in range(n)]


def outcome_rewards(
    gen: torch.Generator, mask: torch.Tensor, sizes: tuple[int, ...], equal_group: int | None = 1
) -> torch.Tensor:
    """Token-level rewards: one 0/1 or fractional score per row on its last masked token (position 0
    for an empty row); group `equal_group` gets the same score on every row."""
    rows, length = mask.shape
    scores = torch.where(
        torch.rand(rows, generator=gen) < 0.5,
        torch.randint(0, 2, (rows,), generator=gen).float(),
        torch.rand(rows, generator=gen),
    )
    if equal_group is not None:
        start = sum(sizes[:equal_group])
        scores[start : start + sizes[equal_group]] = 0.7
    last = torch.where(
        mask.sum(-1) > 0, length - 1 - mask.flip(-1).argmax(-1), torch.zeros(rows, dtype=torch.long)
    )
    rewards = torch.zeros(rows, length)
    rewards[torch.arange(rows), last] = scores
    return rewards


def make_batch(
    seed: int,
    sizes: tuple[int, ...] = (1, 3, 4, 2, 6),
    length: int = 16,
    holes: bool = True,
    drift: float = 0.3,
) -> Batch:
    """A batch of sum(sizes) rows; log-probs drift from old ones by ~`drift` nats, rollout ones by more."""
    gen = torch.Generator().manual_seed(seed)
    rows = sum(sizes)
    mask = random_mask(gen, rows, length, holes)
    old = -torch.rand(rows, length, generator=gen) * 4 - 0.05
    log_probs = (old + drift * torch.randn(rows, length, generator=gen)).clamp(max=-1e-3)
    rollout = (old + 1.5 * drift * torch.randn(rows, length, generator=gen)).clamp(max=-1e-3)
    return Batch(
        log_probs=log_probs,
        old_log_probs=old,
        rollout_logprobs=rollout,
        advantages=2.0 * torch.randn(rows, length, generator=gen),
        mask=mask,
        rewards=outcome_rewards(gen, mask, sizes),
        values=torch.randn(rows, length, generator=gen),
        uids=group_uids(sizes),
    )


def as_float(value: object) -> float:
    """A metric as a float (ours are 0-d tensors, SkyRL's floats)."""
    return float(value.item()) if isinstance(value, torch.Tensor) else float(value)


def assert_metrics_close(ours: dict, theirs: dict, extra: tuple[str, ...] = ()) -> None:
    """Every metric of theirs is ours too, within TOL; ours has no others except `extra`."""
    assert set(ours) - set(extra) == set(theirs), (sorted(ours), sorted(theirs))
    for key, value in theirs.items():
        torch.testing.assert_close(
            torch.tensor(as_float(ours[key]), dtype=torch.float64),
            torch.tensor(as_float(value), dtype=torch.float64),
            equal_nan=True,
            **TOL,
            msg=lambda m, key=key: f"metric {key}: {m}",
        )


def fake_trainer(algorithm: object, micro_batch_size: int) -> SimpleNamespace:
    """What SkyRL's RayPPOTrainer methods read of `self` for advantage normalization and the KL reward."""
    return SimpleNamespace(
        cfg=SimpleNamespace(
            trainer=SimpleNamespace(algorithm=algorithm, micro_train_batch_size_per_gpu=micro_batch_size)
        ),
        all_metrics={},
        reward_kl_controller=None,
    )
