"""What a rollout produces: `Trajectory` (one episode, aligned per response token) and
`TrajectoryGroup` (the `n` episodes of one prompt)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

from inflight.engine.multimodal import MultimodalInput
from inflight.tasks.base import Problem

ENV_VERSION = -1
"""`versions` entry of tokens the model did not sample (environment observations)."""


@dataclass
class Trajectory:
    """One episode: the prompt and everything after it, aligned per response token."""

    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    loss_mask: list[int]
    reward: float
    finish_reason: str
    num_turns: int = 1
    num_recomputed_tokens: int = 0
    num_cached_tokens: int = 0
    info: dict[str, Any] = field(default_factory=dict)
    reward_failed: bool = False
    """The reward / environment step raised or timed out: the sample scores 0 (`info["reward_error"]`
    says why)."""
    rollout_failed: bool = False
    """The harness failed, not the model (the environment outside its reward: built, reset,
    observation; or the agent raised, timed out, returned no reward): the episode ended there, its
    tokens are kept with loss mask 0 and it is left out of its group's advantages
    (`info["rollout_error"]` says why; see `mark_rollout_failed`)."""
    turn_rewards: list[tuple[int, float]] = field(default_factory=list)
    """Each scored turn's reward where it belongs: `(position, reward)` per environment step, in turn
    order, `position` the index in `response_ids` of the last token the model sampled in that turn
    (-1 only when the response is empty). The rewards sum to `reward` (a failed reward, a failed
    rollout and `zero_reward_on_non_stop` zero them all). A trainer that places rewards on tokens puts
    each on its position; one that scores whole sequences uses `reward`."""
    routed_experts: Any = None
    """A mixture-of-experts model's routing record (numpy [positions, MoE layers, top_k]) when the
    generator asked for it: its last turn's (`RequestOutput.routed_experts`), whose prompt is the
    whole trajectory so far; row i is position `routed_experts_start + i` of prompt + response."""
    routed_experts_start: int = 0
    images: MultimodalInput | None = None
    """A vision-language episode's images (`inflight.engine.multimodal.MultimodalInput`): every image
    whose placeholder tokens are in prompt + response, in the order of their placeholders (the
    prompt's, then those of observations after it); the trainer's forward takes them with the
    tokens (`inflight.train.batch.image_rows`). None: no image."""

    def mark_rollout_failed(self, why: str) -> None:
        """The episode failed outside its reward (a harness fault): it costs this episode only. Its
        tokens stay, with loss mask 0 on every one (nothing of it is trained on), its reward is 0 on
        every turn but is no outcome (the trainer leaves the row out of its group's advantages, so
        the finished siblings' are what the estimator gives them alone), it ends with finish reason
        `rollout_error`, and `info["rollout_error"]` holds `why`."""
        self.reward, self.rollout_failed, self.finish_reason = 0.0, True, "rollout_error"
        self.turn_rewards = [(i, 0.0) for i, _ in self.turn_rewards]
        self.loss_mask = [0] * len(self.loss_mask)
        self.info["rollout_error"] = why

    def steps(self) -> list[Trajectory]:
        """The episode as one sample per model turn (`generator.step_wise_trajectories`). Turn k's
        prompt is the prompt and every response token before the turn (exactly what the engine was
        given for it: turns are token-in/token-out); its response is what the model sampled in that
        turn and what follows it up to the next turn (an appended EOS, the observation: loss mask 0);
        its rewards are the turn rewards at positions inside it (without any, the whole reward is the
        last step's). A turn starts at the response's first token and at every sampled token after
        one the model did not sample (`ENV_VERSION`). A step ends with finish reason `stop`, the last
        one with the episode's. The failure flags and `info` are the episode's."""
        starts = [i for i in range(1, len(self.versions))
                  if self.versions[i] != ENV_VERSION and self.versions[i - 1] == ENV_VERSION]
        bounds = [0, *starts, len(self.response_ids)]  # an empty response: [0, 0], one step
        pairs = list(itertools.pairwise(bounds))
        placed = [(max(i, 0), r) for i, r in self.turn_rewards] or [
            (max(len(self.response_ids) - 1, 0), self.reward)
        ]
        out = []
        for k, (a, b) in enumerate(pairs):
            final = k == len(pairs) - 1
            inside = [(i - a, r) for i, r in placed if a <= i < b or (final and i >= b)]
            out.append(Trajectory(
                self.prompt_ids + self.response_ids[:a], self.response_ids[a:b], self.logprobs[a:b],
                self.versions[a:b], self.loss_mask[a:b], float(sum(r for _, r in inside)),
                self.finish_reason if final else "stop", info=self.info, reward_failed=self.reward_failed,
                rollout_failed=self.rollout_failed, turn_rewards=inside if self.turn_rewards else []))
        return out

    @property
    def usable(self) -> bool:
        """Whether there is a sequence to train on (an episode that failed before its first turn has
        no prompt until its group gives it one: `TrajectoryGroup`)."""
        return bool(self.prompt_ids)

    @property
    def finished(self) -> bool:
        """Whether the episode is an outcome of the model (its harness did not fail)."""
        return not self.rollout_failed

    @property
    def num_generated(self) -> int:
        """Tokens trained on (loss mask 1)."""
        return sum(self.loss_mask)

    @property
    def num_sampled(self) -> int:
        """Tokens the model sampled, trained on or not (overlong filtering masks them)."""
        return sum(v != ENV_VERSION for v in self.versions)

    @property
    def model_versions(self) -> list[int]:
        return [v for v, m in zip(self.versions, self.loss_mask, strict=True) if m]


@dataclass
class TrajectoryGroup:
    """The `n` trajectories of one prompt (a GRPO group), plus where the prompt came from.

    `epoch` / `index`: the prompt's place in the data order (checkpoints record consumed prompts).
    Trajectory i is the prompt's episode i of that epoch (`episode_id`).

    A failed episode (`Trajectory.rollout_failed`) costs itself only: the group is trained on when
    any of its episodes finished (`usable`), and one that failed before its first turn (no tokens)
    is given, on construction, the prompt of the first finished sibling and nothing after it, so
    the group keeps its `n` rows (the trainers cut mini-batches in whole groups) with nothing
    trained on in that row. Rewards are compared among the finished episodes only (`spread`).
    """

    problem: Problem
    trajectories: list[Trajectory]
    epoch: int = 0
    index: int = 0
    generate_s: float = 0.0
    ref: Any = None
    """The data loader's handle of the prompt (set by the trainers)."""

    def __post_init__(self) -> None:
        donor = next((t for t in self.trajectories if t.finished and t.usable), None)
        if donor is None:
            return
        for t in self.trajectories:
            if not t.usable:  # failed before its first turn: a row of the group's, empty and masked
                t.prompt_ids = list(donor.prompt_ids)
                # its prompt's placeholders need their images: all of the donor's when only its prompt
                # held images (a donor with image observations has more, which the forward refuses)
                t.images = donor.images

    def episode_id(self, sample: int) -> str:
        """`<prompt id>:<epoch>:<sample>`, episode `sample` of this prompt in this epoch: what the
        generators seed its requests with (with the run's seed: `request_seed`, an agent session's
        seed). A copy of the group (dynamic sampling's `replace`) carries the same ids."""
        return f"{self.prompt_id}:{self.epoch}:{sample}"

    @property
    def prompt_id(self) -> str:
        return self.problem.id

    @property
    def rewards(self) -> list[float]:
        return [t.reward for t in self.trajectories]

    @property
    def usable(self) -> bool:
        """Some episode finished, and every trajectory has a sequence (see `Trajectory.usable`):
        otherwise the group has no outcome to learn from, and the trainers drop it as `failed`."""
        return any(t.finished for t in self.trajectories) and all(t.usable for t in self.trajectories)

    @property
    def informative(self) -> bool:
        """Rewards differ within the group (otherwise every advantage is zero)."""
        return self.spread > 0

    @property
    def spread(self) -> float:
        """The largest minus the smallest reward of the group's finished episodes (0 without any)."""
        r = [t.reward for t in self.trajectories if t.finished]
        return max(r) - min(r) if r else 0.0
