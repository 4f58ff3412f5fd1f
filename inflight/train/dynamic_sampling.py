"""SkyRL's `trainer.algorithm.dynamic_sampling` in the synchronous trainer: what to do with groups whose
rewards are all equal (no learning signal).

- `filter` (DAPO, arXiv:2503.14476): drop them and sample more batches until `train_batch_size`
  informative groups are collected (the batch is cut to exactly that many; the rest is `surplus`).
- `replace` (POLARIS): once more than `min_replace_ratio` of a batch's prompts are informative, each
  uninformative group is replaced by a copy of a random informative one; otherwise the batch is
  discarded and another sampled.

Sampling more than `max_sample_batches` batches for one training batch (-1: no limit) raises, as in
SkyRL. A group of one sample always counts as informative (SkyRL's rule). Unlike SkyRL, a copy is a
group of its own: SkyRL gives it its source's prompt id, so GRPO pools the two copies into one group
of 2n samples (another standard deviation) and the prompt boundaries of `prompt_mean` break.

The fully-async trainer has no batches: there `filter` is `trainer.fully_async.sample_full_batch`
(uninformative groups are dropped as they finish and others generated in their place) and `replace`
is refused by validation.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass, field

from inflight.config import Config
from inflight.rollout.trajectory import TrajectoryGroup


class DynamicSamplingLimitError(RuntimeError):
    """More than `dynamic_sampling.max_sample_batches` batches were sampled for one training batch."""


def informative(group: TrajectoryGroup) -> bool:
    """Whether a group carries a learning signal: rewards not all equal, or a single sample."""
    return len(group.trajectories) == 1 or group.spread > 0


@dataclass
class DynamicSampler:
    """Batches of groups in, training batches out (`offer`). `target`: `train_batch_size` prompts."""

    kind: str
    target: int
    max_batches: int = 30
    min_replace_ratio: float = 0.3
    seed: int = 0
    collected: list[TrajectoryGroup] = field(default_factory=list)
    batches: int = 0

    @classmethod
    def from_config(cls, cfg: Config) -> DynamicSampler | None:
        """The sampler `trainer.algorithm.dynamic_sampling` asks for, None when its type is null."""
        ds = cfg.trainer.algorithm.dynamic_sampling
        if ds.type is None:
            return None
        if ds.type not in ("filter", "replace"):
            raise ValueError(
                f"trainer.algorithm.dynamic_sampling.type={ds.type!r}: use filter, replace or null"
            )
        return cls(ds.type, cfg.trainer.train_batch_size, ds.max_sample_batches, ds.min_replace_ratio,
                   cfg.trainer.seed)

    def offer(self, groups: list[TrajectoryGroup],
              step: int) -> tuple[list[TrajectoryGroup] | None, list[tuple[TrajectoryGroup, str]]]:
        """One more sampled batch: (the training batch, or None to sample another; the groups not
        trained on with why: `rejected` (no signal), `surplus` (beyond the batch), `discarded` (a
        `replace` batch with too few informative groups)). Raises `DynamicSamplingLimitError` when
        another batch would be more than `max_batches`."""
        self.batches += 1
        ready, dropped = self._filter(groups) if self.kind == "filter" else self._replace(groups, step)
        if ready is None and self.max_batches > 0 and self.batches >= self.max_batches:
            raise DynamicSamplingLimitError(
                f"dynamic sampling ({self.kind}) sampled {self.batches} batches without filling a training "
                f"batch of {self.target} informative prompts "
                f"(trainer.algorithm.dynamic_sampling.max_sample_batches={self.max_batches}): most prompts "
                "get the same reward on every sample; check the data's difficulty, raise max_sample_batches "
                "(-1: no limit) or sample more per prompt"
            )
        if ready is not None:
            self.batches = 0
        return ready, dropped

    def rest(self) -> list[TrajectoryGroup]:
        """The informative groups collected so far (the data ran out: a last, partial batch)."""
        rest, self.collected = self.collected, []
        return rest

    def _filter(self, groups: list[TrajectoryGroup]) -> tuple[list[TrajectoryGroup] | None, list]:
        dropped = [(g, "rejected") for g in groups if not informative(g)]
        self.collected += [g for g in groups if informative(g)]
        if len(self.collected) < self.target:
            return None, dropped
        ready, surplus = self.collected[: self.target], self.collected[self.target :]
        self.collected = []
        return ready, dropped + [(g, "surplus") for g in surplus]

    def _replace(self, groups: list[TrajectoryGroup], step: int) -> tuple[list[TrajectoryGroup] | None, list]:
        good = [g for g in groups if informative(g)]
        if len(good) <= len(groups) * self.min_replace_ratio:
            return None, [(g, "discarded") for g in groups]
        bad = [i for i, g in enumerate(groups) if not informative(g)]
        rng = random.Random(f"{self.seed}-{step}")
        sources = rng.sample(good, len(bad)) if len(good) >= len(bad) else [rng.choice(good) for _ in bad]
        out = list(groups)
        for i, source in zip(bad, sources, strict=True):
            out[i] = dataclasses.replace(source, ref=None)  # a copy: its prompt is consumed by its source
        return out, [(groups[i], "rejected") for i in bad]
